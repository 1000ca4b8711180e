package idempotency

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/idemq/idemq/idempotency/internal/store"
)

// keeper extends the leases of every Do handler of a Ledger that is running, from one
// loop with one statement per tick, as asynq's heartbeater extends all of its leases
// with one call: no goroutine and no statement per delivery. A lease is extended every
// Lease/3; those due within the next half of that go with the ones that are due, so a
// process sends about two statements per Lease/3 however many handlers run. The loop runs
// only while a handler does.
type keeper struct {
	l       *Ledger
	mu      sync.Mutex
	live    map[*leaseHold]struct{}
	running bool
	kick    chan struct{}
	round   chan struct{} // closed when the round in flight ends
}

// leaseHold is one running handler's lease. due and fenceAt are the loop's.
type leaseHold struct {
	ctx     context.Context // the handler's, for its logs
	c       *Claim
	fence   *fenceClock
	cancel  context.CancelCauseFunc
	due     time.Time // next heartbeat
	fenceAt time.Time // the self-fence deadline
	busy    bool      // in the round in flight
}

func newKeeper(l *Ledger) *keeper {
	return &keeper{l: l, live: map[*leaseHold]struct{}{}, kick: make(chan struct{}, 1)}
}

// hold keeps c's lease until release, moving fence with each heartbeat that reaches the
// database and cancelling the handler (cancel, cause ErrLeaseLost) when the lease is lost
// or when it can no longer be sure to hold it.
func (k *keeper) hold(ctx context.Context, c *Claim, fence *fenceClock, cancel context.CancelCauseFunc) *leaseHold {
	h := &leaseHold{ctx: ctx, c: c, fence: fence, cancel: cancel, due: time.Now().Add(k.l.cfg.Lease / 3), fenceAt: fence.get()}
	k.mu.Lock()
	k.live[h] = struct{}{}
	start := !k.running
	k.running = true
	k.mu.Unlock()
	if start {
		go k.run()
	} else {
		select {
		case k.kick <- struct{}{}:
		default:
		}
	}
	return h
}

// release stops keeping h's lease. It returns once no heartbeat of h is in flight, so
// that the handler's completion never meets its own heartbeat.
func (k *keeper) release(h *leaseHold) {
	k.mu.Lock()
	delete(k.live, h)
	round := k.round
	busy := h.busy
	k.mu.Unlock()
	if busy {
		<-round
	}
}

func (k *keeper) run() {
	interval := k.l.cfg.Lease / 3
	wait := time.NewTimer(time.Hour)
	defer wait.Stop()
	for {
		now := time.Now()
		k.mu.Lock()
		if len(k.live) == 0 {
			k.running = false
			k.mu.Unlock()
			return
		}
		var due, fenced []*leaseHold
		next, deadline := now.Add(time.Hour), now.Add(time.Hour)
		for h := range k.live {
			switch {
			case !now.Before(h.fenceAt):
				fenced = append(fenced, h)
				delete(k.live, h)
				continue
			case !h.due.After(now.Add(interval / 2)):
				due = append(due, h)
				h.busy = true
			default:
				next = minTime(next, h.due)
			}
			next, deadline = minTime(next, h.fenceAt), minTime(deadline, h.fenceAt)
		}
		var round chan struct{}
		if len(due) > 0 {
			round = make(chan struct{})
			k.round = round
		}
		k.mu.Unlock()

		for _, h := range fenced {
			k.l.selfFenced(h.ctx, h.c, h.cancel)
		}
		if len(due) > 0 {
			k.beat(due, deadline)
			k.mu.Lock()
			for _, h := range due {
				h.busy = false
			}
			k.round = nil
			k.mu.Unlock()
			close(round)
			continue
		}
		wait.Reset(time.Until(next))
		select {
		case <-wait.C:
		case <-k.kick:
			wait.Stop() // no stale tick is left behind (timers since Go 1.23)
		}
	}
}

// beat extends the leases of hs in one statement, bounded by deadline (the earliest
// self-fence deadline of any live lease, so that no handler's self-fencing waits for it).
func (k *keeper) beat(hs []*leaseHold, deadline time.Time) {
	l := k.l
	interval := l.cfg.Lease / 3
	slices.SortFunc(hs, func(a, b *leaseHold) int { return strings.Compare(a.c.Key, b.c.Key) })
	ps := make([]store.LeaseParams, len(hs))
	for i, h := range hs {
		ps[i] = store.LeaseParams{Key: h.c.Key, Fence: h.c.Fence, Owner: h.c.owner, Lease: l.leaseFor(h.c.deadline)}
	}
	sent := time.Now()
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	held, err := l.writes.ExtendLeases(ctx, l.hbPool, ps)
	cancel()
	l.observeBatch(BatchHeartbeat, len(hs))
	for i, h := range hs {
		c := h.c
		switch {
		case err != nil:
			l.log.WarnContext(h.ctx, "idempotency: heartbeat failed; retrying until the self-fence deadline", "task_type", c.TaskType, "key", c.Key, "fence", c.Fence,
				"err", asUnavailable(ctx, fmt.Errorf("idempotency: heartbeat: %w", err)), "self_fence_in", time.Until(h.fenceAt))
			h.due = time.Now().Add(min(interval, max(time.Until(h.fenceAt)/4, time.Millisecond)))
		case !held[i]:
			l.leaseLost(h.ctx, c, "heartbeat")
			h.cancel(fmt.Errorf("%w: key %q fence %d taken over", ErrLeaseLost, c.Key, c.Fence))
			k.mu.Lock()
			delete(k.live, h)
			k.mu.Unlock()
		default:
			if !l.cfg.UnsafeNoFencing {
				h.fenceAt = l.selfFenceAt(sent, ps[i].Lease)
				h.fence.set(h.fenceAt)
			}
			h.due = sent.Add(interval)
		}
	}
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}
