package idempotency

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// The ledger's span attributes, as asynqmw's delivery spans name them.
var (
	attrKey     = attribute.Key("idemq.key")
	attrFence   = attribute.Key("idemq.fence")
	attrAttempt = attribute.Key("idemq.attempt")
	attrOutcome = attribute.Key("idemq.outcome")
)

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

// startSpan starts one of Do's spans ("idemq.claim", "idemq.handler", "idemq.complete")
// for key, under ctx's span (a delivery's).
func (l *Ledger) startSpan(ctx context.Context, name, key string) (context.Context, trace.Span) {
	ctx, span := l.tracer.Start(ctx, name)
	if span.IsRecording() {
		span.SetAttributes(attrKey.String(key))
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
		span.SetAttributes(attrOutcome.String(outcomeCached), attrFence.Int64(cr.Completed.Fence))
	case cr.Claim != nil && cr.Claim.Attempt > 1:
		span.SetAttributes(attrOutcome.String(outcomeTakeover), attrFence.Int64(cr.Claim.Fence), attrAttempt.Int(cr.Claim.Attempt))
	case cr.Claim != nil:
		span.SetAttributes(attrOutcome.String(outcomeClaimed), attrFence.Int64(cr.Claim.Fence), attrAttempt.Int(cr.Claim.Attempt))
	case errors.As(err, &busy):
		span.SetAttributes(attrOutcome.String(outcomeBusy), attrFence.Int64(busy.Fence))
	case errors.Is(err, ErrMismatch):
		span.SetAttributes(attrOutcome.String(outcomeMismatch))
	case errors.Is(err, ErrFailed):
		span.SetAttributes(attrOutcome.String(outcomeFailed))
	case errors.Is(err, ErrNeedsAttention):
		span.SetAttributes(attrOutcome.String(outcomeNeedsAttention))
	default:
		span.SetAttributes(attrOutcome.String(outcomeError))
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// endFinishSpan records how c's claim ended: completed, failed (the handler's error
// recorded), lease_lost (a newer claim holds the key), self_fenced (no heartbeat reached
// the database in time), both told by cause, the handler context's, or error.
func endFinishSpan(span trace.Span, c *Claim, handlerErr, err, cause error) {
	if !span.IsRecording() {
		span.End()
		return
	}
	span.SetAttributes(attrFence.Int64(c.Fence))
	var fenced *selfFencedError
	switch {
	case errors.As(cause, &fenced):
		span.SetAttributes(attrOutcome.String("self_fenced"))
	case errors.Is(err, ErrLeaseLost) || errors.Is(cause, ErrLeaseLost):
		span.SetAttributes(attrOutcome.String("lease_lost"))
	case err != nil:
		span.SetAttributes(attrOutcome.String(outcomeError))
		span.SetStatus(codes.Error, err.Error())
	case handlerErr != nil:
		span.SetAttributes(attrOutcome.String("failed"))
	default:
		span.SetAttributes(attrOutcome.String("completed"))
	}
	span.End()
}
