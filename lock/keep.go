package lock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// The Batcher's refresh loop: every lock kept (Batcher.Keep) is refreshed from one
// goroutine, the locks due at a time in one pipeline.

// kept is a lock the refresh loop keeps (Batcher.Keep).
type kept struct {
	lk       *Lock
	interval time.Duration
	onLost   func(cause error)

	next    time.Time // the next refresh; guarded by the Batcher's kept.mu
	lastErr error     // the last Redis error since the last refresh; likewise

	mu    sync.Mutex // held while the loss is reported
	done  bool       // stopped or lost
	cause error      // the loss
}

// Keep keeps lk alive until stop is called: the Batcher's refresh loop refreshes it
// every third of the TTL it was obtained with, in one pipeline with the other locks then
// due (a lock due within a quarter interval goes along), and after a Redis error retries
// it every quarter interval. When the lock is lost, onLost (if not nil) is called once,
// on the loop's goroutine, with the cause: ErrLockLost when Redis no longer holds our
// token, or an error wrapping it (and the last Redis error) when refreshes kept failing
// until the TTL ran out by our own clock, counted from the send time of the last
// successful refresh. onLost must be quick, must not call stop, and is never called
// after stop returned.
//
// stop ends the keeping and returns the loss (nil if the lock was not lost). It does not
// release the lock, and it is safe to call more than once and from any goroutine.
func (b *Batcher) Keep(lk *Lock, onLost func(cause error)) (stop func() error) {
	until, ttl := lk.validUntil()
	kp := &kept{lk: lk, interval: max(ttl/3, time.Millisecond), onLost: onLost}
	kp.next = time.Now().Add(kp.interval)
	k := &b.kept
	k.mu.Lock()
	k.locks[kp] = struct{}{}
	switch {
	case !k.running:
		k.running = true
		go b.keepLoop()
	case kp.next.Before(k.wakeAt) || until.Before(k.wakeAt):
		select {
		case k.wake <- struct{}{}:
		default:
		}
	}
	k.mu.Unlock()
	return func() error {
		k.mu.Lock()
		delete(k.locks, kp)
		k.mu.Unlock()
		kp.mu.Lock()
		defer kp.mu.Unlock()
		kp.done = true
		return kp.cause
	}
}

// keepLoop refreshes the kept locks as they come due, until none is left.
func (b *Batcher) keepLoop() {
	k := &b.kept
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		now := time.Now()
		wakeAt := now.Add(time.Hour)
		var due, expired []*kept
		k.mu.Lock()
		if len(k.locks) == 0 {
			k.running = false
			k.mu.Unlock()
			return
		}
		for kp := range k.locks {
			until, _ := kp.lk.validUntil()
			switch {
			case !now.Before(until):
				expired = append(expired, kp)
				delete(k.locks, kp)
			case !now.Before(kp.next.Add(-kp.interval / 4)):
				due = append(due, kp)
			default:
				wakeAt = minTime(wakeAt, minTime(kp.next.Add(-kp.interval/4), until))
			}
		}
		k.wakeAt = wakeAt
		lastErrs := make([]error, len(expired))
		for i, kp := range expired {
			lastErrs[i] = kp.lastErr
		}
		k.mu.Unlock()

		for i, kp := range expired {
			lastErr := lastErrs[i]
			if lastErr == nil {
				lastErr = errors.New("no refresh answered in time")
			}
			b.locker.log.Warn("lock lost: TTL ran out before a refresh succeeded", "key", kp.lk.key, "error", lastErr)
			kp.lose(fmt.Errorf("%w: %q not refreshed before its TTL ran out: %w", ErrLockLost, kp.lk.key, lastErr))
		}
		if len(due) > 0 {
			b.refresh(due)
			continue
		}
		timer.Reset(time.Until(wakeAt))
		select {
		case <-timer.C:
		case <-k.wake:
			timer.Stop()
		}
	}
}

// refresh refreshes due in one pipeline, within the earliest of their TTLs.
func (b *Batcher) refresh(due []*kept) {
	sent := time.Now()
	deadline := sent.Add(time.Hour)
	calls := make([]Call, len(due))
	ttls := make([]time.Duration, len(due))
	for i, kp := range due {
		until, ttl := kp.lk.validUntil()
		deadline = minTime(deadline, until)
		ttls[i] = ttl
		calls[i] = Call{Script: refreshScript, Keys: []string{kp.lk.rkey}, Args: []any{kp.lk.token, ttl.Milliseconds()}}
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	cmds := runBy(ctx, b.locker.client, calls)
	cancel()
	k := &b.kept
	var lost []*kept
	k.mu.Lock()
	for i, kp := range due {
		n, err := cmds[i].Int64()
		switch {
		case err != nil:
			b.locker.log.Warn("lock refresh failed; retrying until the TTL runs out", "key", kp.lk.key, "error", err)
			kp.lastErr = err
			// Due again in a quarter interval (a refresh goes a quarter early).
			kp.next = time.Now().Add(max(kp.interval/2, time.Millisecond))
		case n != 1:
			if _, ok := k.locks[kp]; ok {
				delete(k.locks, kp)
				lost = append(lost, kp)
			}
		default:
			kp.lk.extended(sent, ttls[i])
			kp.lastErr = nil
			kp.next = sent.Add(kp.interval)
		}
	}
	k.mu.Unlock()
	for _, kp := range lost {
		b.locker.log.Warn("lock lost: Redis no longer holds our token", "key", kp.lk.key)
		kp.lose(ErrLockLost)
	}
}

// runBy is runCalls, answered by ctx's deadline at the latest: a client that ignores
// deadlines (go-redis without ContextTimeoutEnabled) may wait on a Redis that stopped
// answering for much longer, and the loop must still see the TTL run out. The late
// answer is dropped.
func runBy(ctx context.Context, client Client, calls []Call) []*redis.Cmd {
	answer := make(chan []*redis.Cmd, 1)
	go func() { answer <- runCalls(ctx, client, calls) }()
	select {
	case cmds := <-answer:
		return cmds
	case <-ctx.Done():
		cmds := make([]*redis.Cmd, len(calls))
		for i := range cmds {
			cmds[i] = redis.NewCmd(ctx)
			cmds[i].SetErr(ctx.Err())
		}
		return cmds
	}
}

// lose records the loss once and reports it, unless the keeping was stopped.
func (kp *kept) lose(cause error) {
	kp.mu.Lock()
	defer kp.mu.Unlock()
	if kp.done {
		return
	}
	kp.done, kp.cause = true, cause
	if kp.onLost != nil {
		kp.onLost(cause)
	}
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}
