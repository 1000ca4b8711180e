package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// Do runs fn at most once per completed key, in leased mode: for effects outside this
// database (a payment provider, an email). It claims req.Key (the claim commits first),
// runs fn with the key and fence in its context (FromContext; pass the key to the
// provider as its idempotency key), heartbeats every Lease/3 while fn runs, and records
// fn's result with a fenced, durable Complete.
//
// A duplicate of a completed key gets the stored result (Result.Cached) without running
// fn. The other claim outcomes come back as Claim's errors (*BusyError, *FailedError,
// *MismatchError, ErrNeedsAttention).
//
// fn's context is cancelled, with context.Cause wrapping ErrLeaseLost, as soon as a
// heartbeat finds the lease taken, or when no heartbeat reached the database by the
// self-fence deadline (send time of the last successful heartbeat + lease -
// Config.SelfFenceMargin, on the monotonic clock). fn should then stop; its result is
// still offered to Complete, which refuses it (ErrLeaseLost) unless nobody took over.
//
// When fn returns an error, Do records it with Fail (permanent if IsPermanent, else the
// lease ends at once for a retry) and returns fn's error, joined with Fail's error if
// Fail failed. When fn panics, Do ends the lease at once (a fenced, retryable Fail) and
// panics again with the same value.
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
	fctx, cancel := context.WithCancelCause(withClaim(hctx, c.Key, c.Fence))
	defer cancel(nil)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		l.heartbeatLoop(fctx, c, stop, cancel)
	}()
	endHeartbeats := func() {
		close(stop)
		<-done
	}

	out, ferr, panicked, pval := runFn(fctx, fn)
	endHeartbeats()
	if ferr != nil {
		span.RecordError(ferr)
	}
	span.End()
	// The completion runs in its span's context: a group-committed round links to it.
	ctx, span = l.startSpan(ctx, "idemq.complete", req.Key)
	var finishErr error // the completion's or the Fail's own error
	defer func() { endFinishSpan(span, c, ferr, finishErr, context.Cause(fctx)) }()

	if panicked {
		if finishErr = l.Fail(ctx, c, fmt.Errorf("handler panicked: %v", pval)); finishErr != nil {
			l.log.ErrorContext(ctx, "idempotency: end lease after panic", "task_type", c.TaskType, "key", c.Key, "fence", c.Fence, "err", finishErr)
		}
		panic(pval)
	}
	if ferr != nil {
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

// heartbeatLoop extends c's lease every Lease/3 until stop closes. It cancels the handler
// (cause ErrLeaseLost) when the lease is lost or when it can no longer be sure to hold it.
func (l *Ledger) heartbeatLoop(ctx context.Context, c *Claim, stop <-chan struct{}, cancel context.CancelCauseFunc) {
	interval := l.cfg.Lease / 3
	// The claim itself counts as the first successful heartbeat.
	fenceAt := c.sentAt.Add(c.lease - l.cfg.SelfFenceMargin)
	next := time.NewTimer(interval)
	defer next.Stop()
	if l.cfg.UnsafeNoFencing {
		fenceAt = time.Now().Add(100 * 365 * 24 * time.Hour) // never: negative controls only
	}
	selfFence := time.NewTimer(time.Until(fenceAt))
	defer selfFence.Stop()
	for {
		select {
		case <-stop:
			return
		case <-selfFence.C:
			l.selfFenced(ctx, c, cancel)
			return
		case <-next.C:
		}
		sent := time.Now()
		lease := l.leaseFor(c.deadline)
		hctx, hcancel := context.WithDeadline(context.WithoutCancel(ctx), fenceAt)
		_, err := l.Heartbeat(hctx, c)
		hcancel()
		switch {
		case errors.Is(err, ErrLeaseLost):
			cancel(fmt.Errorf("%w: key %q fence %d taken over", ErrLeaseLost, c.Key, c.Fence))
			return
		case err != nil:
			l.log.WarnContext(ctx, "idempotency: heartbeat failed; retrying until the self-fence deadline", "task_type", c.TaskType, "key", c.Key, "fence", c.Fence, "err", err, "self_fence_in", time.Until(fenceAt))
			if !time.Now().Before(fenceAt) {
				l.selfFenced(ctx, c, cancel)
				return
			}
			next.Reset(min(interval, max(time.Until(fenceAt)/4, time.Millisecond)))
		default:
			if !l.cfg.UnsafeNoFencing {
				fenceAt = sent.Add(lease - l.cfg.SelfFenceMargin)
				selfFence.Reset(time.Until(fenceAt))
			}
			next.Reset(interval)
		}
	}
}

func (l *Ledger) selfFenced(ctx context.Context, c *Claim, cancel context.CancelCauseFunc) {
	l.observe(EventSelfFenced, c.TaskType)
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
