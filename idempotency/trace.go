package idempotency

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency/internal/store"
)

// The span attributes idemq sets, on the ledger's spans and on asynqmw's delivery spans.
const (
	AttrKey     = attribute.Key("idemq.key")      // the job's idempotency key
	AttrFence   = attribute.Key("idemq.fence")    // the claim's fence (of the run that did the work, when cached)
	AttrAttempt = attribute.Key("idemq.attempt")  // the ledger's claim count; asynq's delivery attempt on a delivery
	AttrOutcome = attribute.Key("idemq.outcome")  // what the span's step decided
	AttrStep    = attribute.Key("idemq.step")     // a recorded step's name (Step, StepTx)
	AttrStepKey = attribute.Key("idemq.step_key") // a recorded step's key, <job key>#s/<name>
)

// TraceParent returns the W3C traceparent of ctx's span when it is valid and sampled, else
// "": what a job records to continue its request's trace (HeaderTraceParent).
func TraceParent(ctx context.Context) string {
	if sc := trace.SpanContextFromContext(ctx); !sc.IsValid() || !sc.IsSampled() {
		return ""
	}
	carrier := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, carrier)
	return carrier[HeaderTraceParent]
}

// ContextWithTraceParent returns ctx carrying, as its remote parent span, the W3C
// traceparent tp ("" or malformed: ctx as it is).
func ContextWithTraceParent(ctx context.Context, tp string) context.Context {
	if tp == "" {
		return ctx
	}
	return propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier{HeaderTraceParent: tp})
}

// Claim outcomes, as the claim span's idemq.outcome.
const (
	outcomeClaimed        = "claimed"
	outcomeTakeover       = "takeover"
	outcomeCached         = "cached"
	outcomeBusy           = "busy"
	outcomeMismatch       = "mismatch"
	outcomeFailed         = "failed"
	outcomeNeedsAttention = "needs_attention"
	outcomeError          = "error"
)

// startSpan starts one of Do's spans ("idemq.claim", "idemq.handler", "idemq.complete",
// and "idemq.step" under the handler's)
// for key, under ctx's span (a delivery's).
func (l *Ledger) startSpan(ctx context.Context, name, key string) (context.Context, trace.Span) {
	ctx, span := l.tracer.Start(ctx, name)
	if span.IsRecording() {
		span.SetAttributes(AttrKey.String(key))
	}
	return ctx, span
}

// endClaimSpan records what the claim decided: a new claim (claimed, or takeover when the
// key was claimed before), the stored result (cached, with the fence that did the work),
// or a refusal.
func endClaimSpan(span trace.Span, cr ClaimResult, err error) {
	if !span.IsRecording() {
		span.End()
		return
	}
	var busy *BusyError
	switch {
	case cr.Completed != nil:
		span.SetAttributes(AttrOutcome.String(outcomeCached), AttrFence.Int64(cr.Completed.Fence))
	case cr.Claim != nil && cr.Claim.Attempt > 1:
		span.SetAttributes(AttrOutcome.String(outcomeTakeover), AttrFence.Int64(cr.Claim.Fence), AttrAttempt.Int(cr.Claim.Attempt))
	case cr.Claim != nil:
		span.SetAttributes(AttrOutcome.String(outcomeClaimed), AttrFence.Int64(cr.Claim.Fence), AttrAttempt.Int(cr.Claim.Attempt))
	case errors.As(err, &busy):
		span.SetAttributes(AttrOutcome.String(outcomeBusy), AttrFence.Int64(busy.Fence))
	case errors.Is(err, ErrMismatch):
		span.SetAttributes(AttrOutcome.String(outcomeMismatch))
	case errors.Is(err, ErrFailed):
		span.SetAttributes(AttrOutcome.String(outcomeFailed))
	case errors.Is(err, ErrNeedsAttention):
		span.SetAttributes(AttrOutcome.String(outcomeNeedsAttention))
	default:
		span.SetAttributes(AttrOutcome.String(outcomeError))
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// endTxSpan records what a DoTx transaction decided: its claim's outcome as for Do
// (claimed or takeover when it completed the key, cached, busy, mismatch, …, or error when
// the transaction rolled back) and the fence that did the work.
func endTxSpan(span trace.Span, c *Claim, res Result, err error) {
	switch {
	case err != nil:
		endClaimSpan(span, ClaimResult{}, err)
	case res.Cached:
		endClaimSpan(span, ClaimResult{Completed: &res}, nil)
	default: // c completed the key
		endClaimSpan(span, ClaimResult{Claim: c}, nil)
	}
}

// endFinishSpan records how c's claim ended: completed, failed (the handler's error
// recorded), lease_lost (a newer claim holds the key), self_fenced (no heartbeat reached
// the database in time), both told by cause, the handler context's, or error.
func endFinishSpan(span trace.Span, c *Claim, handlerErr, err, cause error) {
	if !span.IsRecording() {
		span.End()
		return
	}
	span.SetAttributes(AttrFence.Int64(c.Fence))
	var fenced *selfFencedError
	switch {
	case errors.As(cause, &fenced):
		span.SetAttributes(AttrOutcome.String("self_fenced"))
	case errors.Is(err, ErrLeaseLost) || errors.Is(cause, ErrLeaseLost):
		span.SetAttributes(AttrOutcome.String("lease_lost"))
	case err != nil:
		span.SetAttributes(AttrOutcome.String(outcomeError))
		span.SetStatus(codes.Error, err.Error())
	case handlerErr != nil:
		span.SetAttributes(AttrOutcome.String("failed"))
	default:
		span.SetAttributes(AttrOutcome.String("completed"))
	}
	span.End()
}

// endStepSpan records how a step call named name ended: its name and key, its outcome
// (ran, cached, lease_lost, mismatch, error) and the fence of the claim that recorded it,
// this delivery's or, when cached, the earlier one's; a failed call's error is the span's
// status.
func endStepSpan(span trace.Span, c *Claim, name string, call stepCall, done *store.StepRow, outcome StepOutcome, err error) {
	if !span.IsRecording() {
		span.End()
		return
	}
	fence := c.Fence
	if done != nil && err == nil {
		fence = done.Fence
	}
	span.SetAttributes(AttrStep.String(name), AttrOutcome.String(string(outcome)), AttrFence.Int64(fence))
	if call.stepKey != "" {
		span.SetAttributes(AttrStepKey.String(call.stepKey))
	}
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
