package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
)

// Do runs fn at most once per completed key, in leased mode: for effects outside this
// database (a payment provider, an email). It claims req.Key (the claim commits first),
// runs fn with the key and fence in its context (FromContext; pass the key to the
// provider as its idempotency key), heartbeats every Lease/3 while fn runs (one
// statement per tick for all of the Ledger's running handlers), and records
// fn's result with a fenced, durable Complete.
//
// A duplicate of a completed key gets the stored result (Result.Cached) without running
// fn. The other claim outcomes come back as Claim's errors (*BusyError, *FailedError,
// *MismatchError, ErrNeedsAttention).
//
// fn's context is cancelled, with context.Cause wrapping ErrLeaseLost, as soon as a
// heartbeat finds the lease taken, or when no heartbeat reached the database by the
// self-fence deadline (send time of the last successful heartbeat + lease -
// Config.SelfFenceMargin, on the monotonic clock; LeaseDeadline reads it from fn's
// context). fn should then stop; its result is still offered to Complete, which refuses
// it (ErrLeaseLost) unless nobody took over.
//
// When fn returns an error, Do records it with Fail (permanent if IsPermanent, else the
// lease ends at once for a retry) and returns fn's error, joined with Fail's error if
// Fail failed. When fn panics, Do ends the lease at once (a fenced, retryable Fail) and
// panics again with the same value. But when Do itself cancelled fn (lease lost or
// self-fenced), a retryable error or a panic leaves the lease as it is, to lapse on the
// database clock: a call fn had in flight may still be taking effect, and no other
// delivery may take the key over before the lease ends.
//
// Honest limit: if the process dies after fn's external call but before the completion,
// a later delivery runs fn again with the same key; exactly-once then rests on the
// provider honouring the key. Safe for concurrent use.
func (l *Ledger) Do(ctx context.Context, req Request, fn func(ctx context.Context) (json.RawMessage, error)) (Result, error) {
	// Spans under the delivery's, when tracing is on: the claim, the handler, the
	// completion (endClaimSpan, endFinishSpan say what each decided).
	cctx, span := l.startSpan(ctx, "idemq.claim", req.Key)
	cr, err := l.Claim(cctx, req)
	endClaimSpan(span, cr, err)
	if err != nil {
		return Result{}, err
	}
	if cr.Completed != nil {
		return *cr.Completed, nil
	}
	c := cr.Claim

	hctx, span := l.startSpan(ctx, "idemq.handler", req.Key)
	fence := &fenceClock{}
	fence.set(l.selfFenceAt(c.sentAt, c.lease))
	fctx, cancel := context.WithCancelCause(l.withSteps(context.WithValue(withClaim(hctx, c.Key, c.Fence), fenceClockKey{}, fence), c))
	defer cancel(nil)
	lease := l.keeper.hold(fctx, c, fence, cancel)
	out, ferr, panicked, pval := runFn(fctx, fn)
	l.keeper.release(lease)
	if ferr != nil {
		span.RecordError(ferr)
	}
	span.End()
	// The completion runs in its span's context: a group-committed round links to it.
	ctx, span = l.startSpan(ctx, "idemq.complete", req.Key)
	var finishErr error // the completion's or the Fail's own error
	defer func() { endFinishSpan(span, c, ferr, finishErr, context.Cause(fctx)) }()

	// Cancelled by Do (lease lost or self-fenced): whatever fn had in flight may still take
	// effect, so a retryable outcome leaves the lease to lapse instead of ending it.
	lapse := errors.Is(context.Cause(fctx), ErrLeaseLost)
	if lapse && (panicked || (ferr != nil && !IsPermanent(ferr))) {
		l.log.WarnContext(ctx, "idempotency: handler stopped after its lease was lost; the lease is left to lapse", "task_type", c.TaskType, "key", c.Key, "fence", c.Fence)
	}
	if panicked {
		if lapse {
			panic(pval)
		}
		if finishErr = l.Fail(ctx, c, fmt.Errorf("handler panicked: %v", pval)); finishErr != nil {
			l.log.ErrorContext(ctx, "idempotency: end lease after panic", "task_type", c.TaskType, "key", c.Key, "fence", c.Fence, "err", finishErr)
		}
		panic(pval)
	}
	if ferr != nil {
		if lapse && !IsPermanent(ferr) {
			return Result{}, withLeaseLoss(ferr, fctx)
		}
		if finishErr = l.Fail(ctx, c, ferr); finishErr != nil {
			return Result{}, errors.Join(withLeaseLoss(ferr, fctx), finishErr)
		}
		return Result{}, withLeaseLoss(ferr, fctx)
	}
	var res Result
	res, finishErr = l.complete(ctx, c, out)
	return res, finishErr
}

// withLeaseLoss returns the error of a handler whose context ctx ended because the lease
// was lost (taken over, or self-fenced), so that it wraps ErrLeaseLost whatever the handler
// returned (mostly ctx.Err(), context.Canceled): the caller learns the work was stopped,
// not that it failed.
func withLeaseLoss(ferr error, ctx context.Context) error {
	if cause := context.Cause(ctx); errors.Is(cause, ErrLeaseLost) && !errors.Is(ferr, ErrLeaseLost) {
		return fmt.Errorf("%w: %w", ferr, cause)
	}
	return ferr
}

func runFn(ctx context.Context, fn func(ctx context.Context) (json.RawMessage, error)) (out json.RawMessage, err error, panicked bool, pval any) {
	defer func() {
		if r := recover(); r != nil {
			panicked, pval = true, r
		}
	}()
	out, err = fn(ctx)
	return out, err, false, nil
}

// LeaseDeadline returns the self-fence deadline of the leased handler (Do's fn) that ctx
// belongs to: when Do cancels the handler unless a heartbeat reaches the database first
// (send time of the last successful heartbeat + lease - Config.SelfFenceMargin, on the
// local monotonic clock). Each successful heartbeat moves it later, so read it just before
// each external call and give the call a deadline inside it, with room for the provider
// to finish what it received: the lease ends Config.SelfFenceMargin after it by the
// database clock, and only then may another delivery take the key over. ok is false
// outside a leased handler (DoTx handlers hold their key by a transaction instead).
// Safe for concurrent use.
func LeaseDeadline(ctx context.Context) (deadline time.Time, ok bool) {
	f, ok := ctx.Value(fenceClockKey{}).(*fenceClock)
	if !ok {
		return time.Time{}, false
	}
	return f.get(), true
}

type fenceClockKey struct{}

// fenceClock holds a leased handler's self-fence deadline; the heartbeat loop moves it.
type fenceClock struct{ at atomic.Pointer[time.Time] }

func (f *fenceClock) set(t time.Time) { f.at.Store(&t) }
func (f *fenceClock) get() time.Time  { return *f.at.Load() }

// selfFenceAt is the self-fence deadline of a lease asked for at sent.
func (l *Ledger) selfFenceAt(sent time.Time, lease time.Duration) time.Time {
	if l.cfg.UnsafeNoFencing {
		return time.Now().Add(100 * 365 * 24 * time.Hour) // never: negative controls only
	}
	return sent.Add(lease - l.cfg.SelfFenceMargin)
}

func (l *Ledger) selfFenced(ctx context.Context, c *Claim, cancel context.CancelCauseFunc) {
	l.observe(EventSelfFenced, c.TaskType)
	l.recordClaim(HistorySelfFence, c, "no heartbeat reached the database before the self-fence deadline; handler cancelled")
	l.log.ErrorContext(ctx, "idempotency: no heartbeat reached the database in time; handler cancelled", "task_type", c.TaskType, "key", c.Key, "fence", c.Fence)
	cancel(&selfFencedError{key: c.Key, fence: c.Fence})
}

// selfFencedError is the cause a self-fenced handler's context ends with.
type selfFencedError struct {
	key   string
	fence int64
}

func (e *selfFencedError) Error() string {
	return fmt.Sprintf("%v: key %q fence %d: no heartbeat reached the database before the self-fence deadline", ErrLeaseLost, e.key, e.fence)
}

// Is reports whether target is ErrLeaseLost.
func (e *selfFencedError) Is(target error) bool { return target == ErrLeaseLost }
