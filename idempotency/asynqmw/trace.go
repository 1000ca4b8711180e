package asynqmw

import (
	"context"
	"errors"

	"github.com/hibiken/asynq"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency"
)

const tracerName = "github.com/idemq/idemq/idempotency/asynqmw"

// startSpan starts the consumer span of one delivery of t, named "process <task type>",
// as a child of the trace in the task's traceparent header (the request that accepted the
// job, through the outbox) when it has one; ctx carries it into the handler, so a user's
// own instrumentation nests under it. With no tracer provider installed it is the no-op
// span.
func (w *Worker) startSpan(ctx context.Context, taskType string, t *asynq.Task) (context.Context, trace.Span) {
	ctx = idempotency.ContextWithTraceParent(ctx, t.Headers()[idempotency.HeaderTraceParent])
	ctx, span := w.tracer.Start(ctx, "process "+taskType, trace.WithSpanKind(trace.SpanKindConsumer))
	if !span.IsRecording() { // tracing off: nothing more to pay
		return ctx, span
	}
	span.SetAttributes(
		attribute.String("messaging.system", "asynq"),
		attribute.String("messaging.operation.type", "process"),
		attribute.String("messaging.operation.name", "process"))
	if q, ok := asynq.GetQueueName(ctx); ok {
		span.SetAttributes(attribute.String("messaging.destination.name", q))
	}
	if id, ok := asynq.GetTaskID(ctx); ok {
		span.SetAttributes(attribute.String("messaging.message.id", id))
	}
	if n, ok := asynq.GetRetryCount(ctx); ok {
		span.SetAttributes(idempotency.AttrAttempt.Int(n + 1))
	}
	return ctx, span
}

// endSpan records the delivery's outcome and ends its span: an error status for what asynq
// counts as a failure (a busy key is not one).
func endSpan(span trace.Span, outcome string, err error) {
	if !span.IsRecording() {
		span.End()
		return
	}
	span.SetAttributes(idempotency.AttrOutcome.String(outcome))
	if err != nil {
		if IsFailure(err) && !errors.Is(err, context.Canceled) {
			span.SetStatus(codes.Error, err.Error())
		}
		span.RecordError(err)
	}
	span.End()
}
