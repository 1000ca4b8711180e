package lock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// WatchOptions configures a watchdog (Lock.Watch, Locker.Hold). A nil *WatchOptions
// gives the defaults.
type WatchOptions struct {
	// Interval is the time between refreshes. Each refresh resets the TTL the lock was
	// last obtained or refreshed with. Default: a third of that TTL. After a Redis error
	// the watchdog retries sooner, every Interval/4. Keep it well below the TTL: the
	// watchdog declares the lock lost once the TTL runs out without a successful refresh.
	Interval time.Duration

	// IgnoreLoss keeps the watchdog's context alive when the lock is lost: the work goes
	// on without mutual exclusion (use it when something else, such as a fenced
	// ledger, guards the work), and OnLost and stop still report the loss. Default:
	// false, losing the lock cancels the context with the loss as its cause.
	IgnoreLoss bool

	// OnLost, when set, is called once when the lock is lost, with the cause (see
	// Lock.Watch), on the watchdog's goroutine, after the context is cancelled. It is
	// never called after stop has returned, and it must not call stop.
	OnLost func(cause error)
}

// Watch starts a watchdog that keeps the lock alive for long work: it refreshes the
// lock every opts.Interval until stop is called. The watchdog outlives ctx: work that
// winds down after ctx is cancelled stays protected until stop.
//
// The returned context is derived from ctx. Unless opts.IgnoreLoss is set, it is
// cancelled as soon as the lock is lost, and context.Cause reports why:
//   - ErrLockLost itself when a refresh finds that Redis no longer holds our token;
//   - an error wrapping ErrLockLost (and the last Redis error) when refreshes kept
//     failing until the lock's TTL ran out by our own monotonic clock, counted from the
//     send time of the last successful refresh: we can no longer prove we hold it.
//
// stop ends the watchdog, cancels the returned context, and returns the loss (nil if
// the lock was not lost). It does not release the lock and does not wait for a refresh
// already in flight (such a refresh can only extend a lock that still holds our token).
// stop is safe to call more than once and from any goroutine. Watch may be called more
// than once on a lock; each watchdog is independent.
func (l *Lock) Watch(ctx context.Context, opts *WatchOptions) (context.Context, func() error) {
	var o WatchOptions
	if opts != nil {
		o = *opts
	}
	until, ttl := l.validUntil()
	if o.Interval <= 0 {
		o.Interval = max(ttl/3, time.Millisecond)
	}

	workCtx, cancelWork := context.WithCancelCause(ctx)
	refreshCtx, cancelRefresh := context.WithCancel(context.WithoutCancel(ctx))
	w := &watchdog{lock: l, opts: o, ctx: refreshCtx, cancelWork: cancelWork}
	w.mu.Lock() // the timer may fire at once
	w.expiry = time.AfterFunc(time.Until(until), w.expired)
	w.mu.Unlock()
	go w.run()

	stop := func() error {
		w.mu.Lock()
		w.stopped = true
		cause := w.cause
		w.mu.Unlock()
		cancelRefresh()
		w.expiry.Stop()
		cancelWork(context.Canceled)
		return cause
	}
	return workCtx, stop
}

type watchdog struct {
	lock       *Lock
	opts       WatchOptions
	ctx        context.Context // for refreshes; cancelled by stop
	cancelWork context.CancelCauseFunc
	expiry     *time.Timer // fires when the lock's TTL has run out by our clock

	mu      sync.Mutex
	stopped bool
	cause   error // set once the lock is lost
	lastErr error // last Redis error since the last successful refresh
}

func (w *watchdog) run() {
	log := w.lock.locker.log.With("key", w.lock.key)
	timer := time.NewTimer(w.opts.Interval)
	defer timer.Stop()
	for {
		select {
		case <-w.ctx.Done():
			return
		case <-timer.C:
		}
		if w.isDone() {
			return
		}
		_, ttl := w.lock.validUntil()
		err := w.lock.Refresh(w.ctx, ttl)
		switch {
		case err == nil:
			until, _ := w.lock.validUntil()
			w.mu.Lock()
			w.lastErr = nil
			if w.cause == nil && !w.stopped {
				w.expiry.Reset(time.Until(until))
			}
			w.mu.Unlock()
			timer.Reset(w.opts.Interval)
		case errors.Is(err, ErrLockLost):
			log.Warn("lock lost: Redis no longer holds our token")
			w.lose(ErrLockLost)
			return
		case w.ctx.Err() != nil:
			return
		default:
			log.Warn("lock refresh failed; retrying until the TTL runs out", "error", err)
			w.mu.Lock()
			w.lastErr = err
			w.mu.Unlock()
			timer.Reset(max(w.opts.Interval/4, time.Millisecond))
		}
	}
}

func (w *watchdog) isDone() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.stopped || w.cause != nil
}

// expired runs on the expiry timer's goroutine.
func (w *watchdog) expired() {
	w.mu.Lock()
	lastErr := w.lastErr
	w.mu.Unlock()
	if lastErr == nil {
		lastErr = errors.New("no refresh answered in time")
	}
	w.lock.locker.log.Warn("lock lost: TTL ran out before a refresh succeeded", "key", w.lock.key, "error", lastErr)
	w.lose(fmt.Errorf("%w: %q not refreshed before its TTL ran out: %w", ErrLockLost, w.lock.key, lastErr))
}

// lose records the loss once, cancels the work unless told not to, and calls OnLost.
// The mutex is held throughout, so that nothing happens after stop has returned.
func (w *watchdog) lose(cause error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped || w.cause != nil {
		return
	}
	w.cause = cause
	w.expiry.Stop()
	if !w.opts.IgnoreLoss {
		w.cancelWork(cause)
	}
	if w.opts.OnLost != nil {
		w.opts.OnLost(cause)
	}
}

// Hold obtains the lock on key for ttl (retrying as opts says), runs fn under a
// watchdog (see Lock.Watch, configured by wopts), and releases the lock when fn
// returns. fn's context is cancelled when the lock is lost, unless wopts.IgnoreLoss is
// set. Hold is safe for concurrent use.
//
// When the lock cannot be obtained, Hold returns Obtain's error (ErrNotObtained, a
// wrapped context error, or a Redis error) without calling fn. Otherwise it returns
// fn's error joined with an error wrapping ErrLockLost if the lock was lost while fn
// ran, or with Release's error; nil when fn succeeded and the lock was held throughout
// and released. The release runs even when ctx is cancelled, and is skipped once the
// lock's TTL has run out by our clock.
func (l *Locker) Hold(ctx context.Context, key string, ttl time.Duration, opts *Options, wopts *WatchOptions, fn func(ctx context.Context) error) error {
	lk, err := l.Obtain(ctx, key, ttl, opts)
	if err != nil {
		return err
	}
	workCtx, stop := lk.Watch(ctx, wopts)
	defer stop() // if fn panics: stop refreshing, let the lock expire
	fnErr := fn(workCtx)
	if lost := stop(); lost != nil {
		return errors.Join(fnErr, lost)
	}
	until, _ := lk.validUntil()
	if !time.Now().Before(until) {
		return errors.Join(fnErr, fmt.Errorf("%w: %q TTL ran out before release", ErrLockLost, key))
	}
	rctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), until)
	defer cancel()
	if err := lk.Release(rctx); err != nil {
		return errors.Join(fnErr, err)
	}
	return fnErr
}
