package asynqmw

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/idemq/idemq/lock"
)

// A scope's Redis lock is shared by the deliveries of this process that need it. The
// first takes it from Redis; the others wait in line, in this process (FIFO, at most
// Config.ScopeWaiters of them), and each is handed the held lock when the one before it
// is done: no release, no obtain, the refresh loop keeping it throughout. A lock is handed
// on only while its last refresh is confirmed for more than half its TTL. After
// Config.ScopeHandoffs handoffs or Config.ScopeHold, whichever comes first, the holder
// asks Redis whether another process found the scope held meanwhile (lock.Options.Want):
// if so, it releases the lock, and the next waiter here asks Redis for it a moment later,
// as the other processes do, so that they get their turn. A delivery whose scope another
// process holds asks Redis again, more and more slowly, for up to Config.ScopeWait (the
// rest of the delivery on its last attempt) before it answers busy and goes back through
// asynq's retry set.

// gate is the process's side of the scope locks.
// A delivery does not wait for its lock's release: the release is queued on the Worker's
// Batcher, with the result write when there is one, and sent with the others of the
// moment (Worker.Wait waits for them).
type gate struct {
	w        *Worker
	mu       sync.Mutex
	scopes   map[string]*scope
	stopping chan struct{} // closed by Worker.Stop: waiters answer busy
	stopOnce sync.Once
}

// scope is the state of one lock scope in this process, while a delivery holds or
// obtains its lock or waits for it.
type scope struct {
	name     string
	taskType string     // of the delivery that took the turn, for LockLost
	lk       *lock.Lock // nil while no delivery holds it from Redis
	unwatch  func() error
	since    time.Time // when lk was taken from Redis
	handoffs int       // since then
	lost     error     // the refresh loop found lk lost: it is not handed on
	// turnLeft counts the handoffs left in this turn once another process waits for the
	// scope (wanted): the deliveries that were in line here when that was first heard.
	turnLeft int
	wanted   bool
	ownKey   bool // the scope is the job's own key: a loss does not cancel (the ledger guards)
	// holds are the deliveries whose turn it is, each with its cancel: one, or, while
	// riding, every transactional delivery that joined the turn (the ledger runs them one
	// at a time: idempotency.Request.Scope).
	holds   map[*scopeHold]context.CancelCauseFunc
	riding  bool     // the turn is transactional deliveries': more of them may join it
	waiters []waiter // FIFO
}

// waiter is a delivery in line: rides, it may join a riding turn.
type waiter struct {
	turn  chan handout
	rides bool
}

// handout is what a waiter is told when its turn comes: the lock is handed over (held:
// run), or it was released (take it from Redis; yield: released for another process,
// which gets a moment's start).
type handout struct {
	held, yield bool
	hold        *scopeHold // held: the turn, made by the delivery that handed it over
}

// scopeHold is a delivery's turn in a scope: its ctx (cancelled when the lock is lost,
// unless the scope is the key) and the lock it holds, if Redis was reachable.
type scopeHold struct {
	g      *gate
	s      *scope
	ctx    context.Context
	handed bool // the lock came from the delivery before, not from Redis
	left   bool // leave ran
}

func newGate(w *Worker) *gate {
	return &gate{w: w, scopes: map[string]*scope{}, stopping: make(chan struct{})}
}

// stop makes every waiter answer busy, and every delivery that comes after it.
func (g *gate) stop() { g.stopOnce.Do(func() { close(g.stopping) }) }

// enter waits for the scope's turn, within patience (the rest of ctx when patient). Its
// errors: lock.ErrNotObtained (busy: the scope stayed held, or its line is full), ctx's
// error, or a Redis error, with which the hold is returned as well: the delivery runs
// guarded by the ledger alone, still one at a time in this process. A delivery that rides
// (a transactional one, whose ledger call carries the scope) joins a turn other riders
// hold, while its bounds allow, instead of waiting for it to end: the ledger runs them
// one after another, in shared transactions.
func (g *gate) enter(ctx context.Context, name, taskType string, ownKey, patient, rides bool) (*scopeHold, error) {
	select {
	case <-g.stopping:
		return nil, lock.ErrNotObtained
	default:
	}
	wait := g.w.cfg.ScopeWait
	if patient {
		wait = time.Until(deadlineOf(ctx))
	}
	giveUp := time.NewTimer(max(wait, 0))
	defer giveUp.Stop()

	g.mu.Lock()
	s := g.scopes[name]
	if s == nil {
		s = &scope{name: name, ownKey: ownKey, riding: rides, holds: map[*scopeHold]context.CancelCauseFunc{}}
		g.scopes[name] = s
		g.mu.Unlock()
		return g.obtain(ctx, s, taskType, giveUp.C)
	}
	if rides && g.joinable(s) {
		s.handoffs++
		h := g.holdLocked(ctx, s, taskType, true)
		g.mu.Unlock()
		g.w.observeLock(ctx, LockHanded, taskType)
		return h, nil
	}
	if len(s.waiters)+len(s.holds) > g.w.cfg.ScopeWaiters {
		g.mu.Unlock()
		return nil, lock.ErrNotObtained
	}
	turn := make(chan handout, 1)
	s.waiters = append(s.waiters, waiter{turn: turn, rides: rides})
	g.mu.Unlock()

	select {
	case h := <-turn:
		return g.take(ctx, s, taskType, h, giveUp.C)
	case <-ctx.Done():
	case <-g.stopping:
	case <-giveUp.C:
	}
	g.mu.Lock()
	if i := slices.IndexFunc(s.waiters, func(w waiter) bool { return w.turn == turn }); i >= 0 {
		s.waiters = slices.Delete(s.waiters, i, i+1)
		g.mu.Unlock()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, lock.ErrNotObtained
	}
	g.mu.Unlock()
	// The turn came as this delivery gave up: pass it on.
	h := <-turn
	if h.held {
		h.hold.leave()
		return nil, lock.ErrNotObtained
	}
	g.passOn(s, h.yield)
	return nil, lock.ErrNotObtained
}

// take starts the turn h gives.
func (g *gate) take(ctx context.Context, s *scope, taskType string, h handout, giveUp <-chan time.Time) (*scopeHold, error) {
	if h.held {
		g.w.observeLock(ctx, LockHanded, taskType)
		return g.adopt(ctx, h.hold, taskType), nil
	}
	if h.yield {
		// The lock was released so that another process may take it: give it the moment
		// its next ask needs.
		t := time.NewTimer(scopeYield)
		select {
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
	}
	return g.obtain(ctx, s, taskType, giveUp)
}

// scopeRetryMax is the longest a delivery waits between two asks for a scope another
// process holds. The holder's release wakes it sooner (lock.Batcher.Freed): a poll
// serves only when that message is lost, or the holder is a build without it.
const scopeRetryMax = 50 * time.Millisecond

// scopeYield is how long a scope released for the other processes is left to them
// before the next delivery of this process asks Redis for it: they were woken by the
// release, and ask within a round trip.
const scopeYield = 5 * time.Millisecond

// obtain takes s's lock from Redis for the delivery whose turn it is, asking again until
// giveUp fires. When it does not get it, the turn goes to the next waiter (which asks
// Redis for itself), and the delivery answers busy.
func (g *gate) obtain(ctx context.Context, s *scope, taskType string, giveUp <-chan time.Time) (*scopeHold, error) {
	retry := lock.ExponentialBackoff(5*time.Millisecond, scopeRetryMax, 1<<30)
	opts := &lock.Options{Want: 4 * g.w.cfg.ScopeHold}
	for n := 1; ; n++ {
		lk, err := g.w.batch.Obtain(ctx, s.name, g.w.cfg.LockTTL, opts)
		switch {
		case err == nil:
			g.w.observeLock(ctx, LockObtained, taskType)
			unwatch := g.w.batch.Keep(lk, func(cause error) { g.lose(s, cause) })
			g.mu.Lock()
			s.lk, s.unwatch, s.since, s.handoffs, s.lost, s.wanted = lk, unwatch, time.Now(), 0, nil, false
			g.mu.Unlock()
			return g.hold(ctx, s, taskType, false), nil
		case !errors.Is(err, lock.ErrNotObtained):
			if ctx.Err() != nil {
				g.passOn(s, false)
				return nil, err
			}
			// Redis failed: the ledger alone guards the work; this process still runs the
			// scope's deliveries one at a time.
			g.w.observeLock(ctx, LockError, taskType)
			return g.hold(ctx, s, taskType, false), err
		}
		if n == 1 {
			g.w.observeLock(ctx, LockWaited, taskType)
		}
		delay, _ := retry.Backoff(n)
		t := time.NewTimer(delay)
		freed, done := g.w.batch.Freed(s.name) // the holder's release wakes this wait
		select {
		case <-t.C:
			done()
			continue
		case <-freed:
			t.Stop()
			done()
			continue
		case <-ctx.Done():
		case <-giveUp:
		case <-g.stopping:
		}
		done()
		t.Stop()
		g.passOn(s, false)
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, lock.ErrNotObtained
	}
}

// hold makes the turn of the delivery whose ctx is ctx.
func (g *gate) hold(ctx context.Context, s *scope, taskType string, handed bool) *scopeHold {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.holdLocked(ctx, s, taskType, handed)
}

// holdLocked is hold, with g.mu held.
func (g *gate) holdLocked(ctx context.Context, s *scope, taskType string, handed bool) *scopeHold {
	return g.register(ctx, &scopeHold{g: g, s: s, handed: handed}, taskType)
}

// adopt makes hd, a turn handed over, the turn of the delivery whose ctx is ctx.
func (g *gate) adopt(ctx context.Context, hd *scopeHold, taskType string) *scopeHold {
	g.mu.Lock()
	defer g.mu.Unlock()
	hd.handed = true
	return g.register(ctx, hd, taskType)
}

// register makes h one of its scope's holds, with a ctx of its own (cancelled at once if
// the lock is lost already, unless the scope is the key). With g.mu held.
func (g *gate) register(ctx context.Context, h *scopeHold, taskType string) *scopeHold {
	hctx, cancel := context.WithCancelCause(ctx)
	h.ctx = hctx
	s := h.s
	s.holds[h], s.taskType = cancel, taskType
	if s.lost != nil && !s.ownKey {
		cancel(s.lost)
	}
	return h
}

// joinable reports whether a riding delivery may join s's turn now: riders hold it, its
// lock is held and confirmed, within its bounds. With g.mu held.
func (g *gate) joinable(s *scope) bool {
	return s.riding && len(s.holds) > 0 && len(s.holds) <= g.w.cfg.ScopeWaiters && s.lk != nil && s.lost == nil && len(s.waiters) == 0 &&
		s.lk.Remaining() > g.w.cfg.LockTTL/2 && !g.bound(s) && !s.wanted && !g.w.batch.Wanted(s.lk)
}

// turnEnds reports whether s's turn ends at this leave because another process waits for
// the scope: once that is heard, the deliveries then in line here are served first. With
// g.mu held.
func (g *gate) turnEnds(s *scope) bool {
	if !s.wanted {
		if !g.w.batch.Wanted(s.lk) {
			return false
		}
		s.wanted, s.turnLeft = true, len(s.waiters)
	}
	return s.turnLeft <= 0
}

// bound reports whether s's turn reached its bounds: other processes that asked get the
// scope before more deliveries of this one. With g.mu held.
func (g *gate) bound(s *scope) bool {
	return s.handoffs >= g.w.cfg.ScopeHandoffs || time.Since(s.since) >= g.w.cfg.ScopeHold
}

// lose runs on the refresh loop when s's lock is lost: the running delivery is cancelled
// (unless the scope is its key), and the lock is not handed on.
func (g *gate) lose(s *scope, cause error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.w.observeLock(context.Background(), LockLost, s.taskType)
	if len(s.holds) == 0 {
		g.w.log.Warn("lock lost while running", "scope", s.name, "err", cause)
	}
	for h := range s.holds { // each delivery holding the turn hears of it, on its span and in its log line
		lockSpanEvent(h.ctx, LockLost, cause)
		g.w.log.WarnContext(h.ctx, "lock lost while running", "scope", s.name, "err", cause)
	}
	s.lost = cause
	if !s.ownKey {
		for _, cancel := range s.holds {
			cancel(cause)
		}
	}
}

// leave ends the delivery's turn: when no other rider holds it, the lock goes to the
// next waiter (with the riders behind it, when it rides), or back to Redis. Only its
// first call does anything.
func (h *scopeHold) leave() { h.leaveWith(nil) }

// leaveWith is leave, sending rw (when not nil) with the lock's release when the lock
// goes back to Redis, or on its own.
func (h *scopeHold) leaveWith(rw *resultWrite) {
	if h.left {
		h.g.w.sendResult(rw)
		return
	}
	h.left = true
	g, s := h.g, h.s
	g.mu.Lock()
	if cancel := s.holds[h]; cancel != nil {
		cancel(context.Canceled)
		delete(s.holds, h)
	}
	if len(s.holds) > 0 {
		g.mu.Unlock()
		g.w.sendResult(rw)
		return
	}
	select {
	case <-g.stopping:
		g.mu.Unlock()
		g.release(s, false, rw)
		return
	default:
	}
	handOn := s.lk != nil && s.lost == nil && len(s.waiters) > 0 && s.lk.Remaining() > g.w.cfg.LockTTL/2
	wanted := handOn && g.turnEnds(s)
	handOn = handOn && !wanted
	bound := g.bound(s)
	g.mu.Unlock()
	if handOn && bound {
		// A process that did not say so (an older build) may be waiting: if it asked,
		// its turn comes now.
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		w, err := g.w.locker.Wanted(ctx, s.name)
		cancel()
		wanted = w || err != nil
	}
	g.mu.Lock()
	if handOn && !wanted && s.lost == nil && len(s.waiters) > 0 && len(s.holds) == 0 {
		if bound {
			s.handoffs, s.since = 0, time.Now()
		}
		// The next waiter's turn, and, when it rides, that of the riders right behind it.
		var next []waiter
		s.riding = s.waiters[0].rides
		for len(s.waiters) > 0 && (len(next) == 0 || s.riding && s.waiters[0].rides) {
			next = append(next, s.waiters[0])
			s.waiters = s.waiters[1:]
			s.handoffs++
			s.turnLeft--
		}
		turns := make([]*scopeHold, len(next))
		for i := range next {
			// Its ctx is set when it takes the turn (take): made here, so that the turn is
			// held before the next delivery can leave it.
			turns[i] = &scopeHold{g: g, s: s}
			s.holds[turns[i]] = func(error) {}
		}
		g.mu.Unlock()
		for i, w := range next {
			w.turn <- handout{held: true, hold: turns[i]}
		}
		g.w.sendResult(rw)
		return
	}
	g.mu.Unlock()
	// The delivery's work is durable: it need not wait for Redis to take the lock back.
	// Until then the scope stays known here, so the scope's next delivery in this
	// process waits in line and asks Redis once the lock is released.
	g.release(s, wanted, rw)
}

// release queues the release of s's lock, with rw when not nil; once Redis answered, the
// turn goes to the next waiter, to take from Redis.
func (g *gate) release(s *scope, yield bool, rw *resultWrite) {
	g.mu.Lock()
	lk, unwatch := s.lk, s.unwatch
	s.lk, s.unwatch = nil, nil
	g.mu.Unlock()
	if unwatch != nil {
		unwatch()
	}
	if lk == nil || lk.Remaining() <= 0 {
		g.w.sendResult(rw)
		g.passOn(s, yield)
		return
	}
	g.w.sendRelease(lk, rw, func(err error) {
		if err != nil && !errors.Is(err, lock.ErrLockLost) {
			g.w.log.Warn("release lock", "scope", s.name, "err", err)
		}
		g.passOn(s, yield)
	})
	g.w.batch.Wake(lk) // after the release: the processes that wait for the scope ask again
}

// passOn gives s's turn to its next waiter, to take from Redis, or forgets s.
func (g *gate) passOn(s *scope, yield bool) {
	g.mu.Lock()
	if len(s.waiters) == 0 {
		delete(g.scopes, s.name)
		g.mu.Unlock()
		return
	}
	next := s.waiters[0]
	s.waiters = s.waiters[1:]
	s.riding = next.rides
	g.mu.Unlock()
	next.turn <- handout{yield: yield}
}

// deadlineOf is ctx's deadline, or a day from now.
func deadlineOf(ctx context.Context) time.Time {
	if d, ok := ctx.Deadline(); ok {
		return d
	}
	return time.Now().Add(24 * time.Hour)
}
