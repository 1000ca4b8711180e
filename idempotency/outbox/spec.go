package outbox

import (
	"cmp"
	"context"
	"time"

	"github.com/hibiken/asynq"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency"
)

// DefaultQueue is the queue of a Spec that names none: asynq's default queue.
const DefaultQueue = "default"

// Spec is everything needed to publish a job: its key, its asynq task type and payload,
// and asynq's options. The outbox stores it and publishes it later (Spec.Task).
type Spec struct {
	Key     string
	Type    string
	Payload []byte
	// Queue is the asynq queue the job is published to; empty is DefaultQueue.
	Queue string
	// MaxRetry is how often asynq retries a failed delivery (asynq.MaxRetry): 0 is none,
	// unlike an asynq task without the option (25); a busy key's retries count too.
	MaxRetry  int
	Timeout   time.Duration
	Retention time.Duration
	// TraceParent is the W3C traceparent the job's deliveries continue (see
	// idempotency.HeaderTraceParent). Enqueue and EnqueueTx fill it from their context
	// (idempotency.TraceParent) when it is empty.
	TraceParent string
	// Steps names the steps the job's handler records (idempotency.Step, StepTx), for the
	// enqueue to check that each step key (<key>#s/<name>) is a valid name within the
	// 255-byte key limit: a job whose step keys cannot be recorded is refused here, not
	// at its first step. It is checked, not stored.
	Steps []string
}

// Task returns the asynq task for s under TaskID taskID (the key for the first publish),
// with the first-enqueue header set to firstEnqueued and s's options; opts come last and
// win.
func (s Spec) Task(taskID string, firstEnqueued time.Time, opts ...asynq.Option) *asynq.Task {
	all := append([]asynq.Option{
		asynq.TaskID(taskID),
		asynq.Queue(s.withDefaults().Queue),
		asynq.MaxRetry(s.MaxRetry),
		asynq.Timeout(s.Timeout),
		asynq.Retention(s.Retention),
	}, opts...)
	headers := idempotency.FirstEnqueuedHeader(firstEnqueued)
	if s.TraceParent != "" {
		headers[idempotency.HeaderTraceParent] = s.TraceParent
	}
	return asynq.NewTaskWithHeaders(s.Type, s.Payload, headers, all...)
}

// withDefaults returns s with DefaultQueue for an empty Queue. Every Spec the Client
// takes in (Enqueue, EnqueueTx, EnqueueManyTx, Publish) passes here first, so that its
// intent's row, its task, the queue registered with asynq and its epoch marker all name
// one queue: never "", which asynq's Inspector (the dashboard) refuses.
func (s Spec) withDefaults() Spec {
	s.Queue = cmp.Or(s.Queue, DefaultQueue)
	return s
}

// withTrace returns s with TraceParent filled from ctx when it has none.
func withTrace(ctx context.Context, s Spec) Spec {
	if s.TraceParent == "" {
		s.TraceParent = idempotency.TraceParent(ctx)
	}
	return s
}

// startPublishSpan starts the producer span of one publish of r, a child of the
// traceparent recorded with its intent.
func (c *Client) startPublishSpan(ctx context.Context, r intentRow) (context.Context, trace.Span) {
	ctx, span := c.tracer.Start(idempotency.ContextWithTraceParent(ctx, r.spec.TraceParent), "publish "+r.spec.Type,
		trace.WithSpanKind(trace.SpanKindProducer))
	if span.IsRecording() {
		span.SetAttributes(
			attribute.String("messaging.system", "asynq"),
			attribute.String("messaging.operation.type", "send"),
			attribute.String("messaging.operation.name", "publish"),
			attribute.String("messaging.destination.name", r.spec.Queue),
			idempotency.AttrKey.String(r.spec.Key),
			attribute.Int("idemq.generation", r.gen))
	}
	return ctx, span
}

// endPublishSpan ends the span of a publish of key with the TaskID it was published under
// (generation gen), or its error.
func endPublishSpan(span trace.Span, key string, gen int, err error) {
	if !span.IsRecording() {
		span.End()
		return
	}
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
		span.RecordError(err)
	} else {
		span.SetAttributes(attribute.String("messaging.message.id", taskID(key, gen)))
	}
	span.End()
}
