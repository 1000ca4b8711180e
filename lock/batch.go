package lock

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed want.lua
	wantLua    string
	wantScript = redis.NewScript(wantLua)
)

// Batcher sends the commands of many locks together, so that a process holding many
// locks pays about one round trip per batch instead of one per lock:
//
//   - Obtain tries to take a lock in one pipeline with the other Obtain calls of the
//     moment: the first call sends at once, and the calls that arrive while a round
//     trip is in flight go together in the next one. There is no waiting delay.
//   - Keep refreshes a held lock from the Batcher's refresh loop, which refreshes every
//     lock due at a time in one pipeline, instead of a goroutine per lock.
//   - Release and Send queue script calls (releases, and the caller's own calls that
//     should go with them) that one goroutine sends in pipelines, in the same way; the
//     caller does not wait for Redis.
//
// On a Redis Cluster go-redis splits a pipeline by hash slot; every script of this
// package touches the keys of one slot, and Send's callers must keep theirs to one slot
// too. One Batcher per Locker and process is enough. Its goroutines run only while it
// has work, so it needs no closing. A Batcher is safe for concurrent use.
type Batcher struct {
	locker *Locker

	obtains struct {
		mu    sync.Mutex
		queue []*obtainTry // to go in the next round trip
		busy  bool         // a round trip is in flight
	}

	writes struct {
		mu      sync.Mutex
		queue   []Call
		running bool       // the flushing goroutine runs
		idle    *sync.Cond // signalled when it stops
	}

	node *node // the wake-ups between processes (wake.go)

	kept struct {
		mu      sync.Mutex
		locks   map[*kept]struct{}
		running bool          // the refresh loop runs
		wakeAt  time.Time     // when it wakes up next
		wake    chan struct{} // wakes it up earlier
	}
}

// NewBatcher returns a Batcher for the locks of l.
func NewBatcher(l *Locker) *Batcher {
	b := &Batcher{locker: l, node: newNode(l.prefix)}
	b.writes.idle = sync.NewCond(&b.writes.mu)
	b.kept.locks = map[*kept]struct{}{}
	b.kept.wake = make(chan struct{}, 1)
	return b
}

// Obtain is Locker.Obtain with each try sent in one pipeline with the tries of the other
// Obtain calls of the moment, and the mark of a busy key (Options.Want) queued like a
// release. Its results and errors are Locker.Obtain's. When ctx ends while its try is in
// flight, Obtain waits for that round trip.
func (b *Batcher) Obtain(ctx context.Context, key string, ttl time.Duration, opts *Options) (*Lock, error) {
	if opts != nil && opts.Want > 0 {
		b.listen()
	}
	return b.locker.obtain(ctx, key, ttl, opts, b.node.token(), b.setNX, b.markWanted)
}

// obtainTry is one SET NX of a batch.
type obtainTry struct {
	rkey, token string
	ttl         time.Duration
	ok          bool
	holder      string // the token that holds rkey, when not ok
	err         error
	// wake tells the caller that its answer is in (false) or that it sends the next
	// round trip (true), for the tries in lead.
	wake chan bool
	lead []*obtainTry
}

// setNX sends SET NX PX GET for rkey in the next round trip, and answers whether it set
// the key and, when not, the holder's token. The caller of the first try in a round
// trip sends it; when the answer is in, it hands the round trip of the tries queued
// meanwhile to the first of them.
func (b *Batcher) setNX(ctx context.Context, rkey, token string, ttl time.Duration) (bool, string, error) {
	t := &obtainTry{rkey: rkey, token: token, ttl: ttl, wake: make(chan bool, 1)}
	q := &b.obtains
	q.mu.Lock()
	batch := []*obtainTry{t}
	if q.busy {
		q.queue = append(q.queue, t)
		q.mu.Unlock()
		var lead bool
		select {
		case lead = <-t.wake:
		case <-ctx.Done():
			q.mu.Lock()
			if i := slices.Index(q.queue, t); i >= 0 {
				q.queue = slices.Delete(q.queue, i, i+1)
				q.mu.Unlock()
				return false, "", ctx.Err()
			}
			q.mu.Unlock()
			lead = <-t.wake // in flight, or its turn to send: within a round trip
		}
		if !lead {
			return t.ok, t.holder, t.err
		}
		batch = t.lead
	} else {
		q.busy = true
		q.mu.Unlock()
	}

	pipe := b.locker.client.Pipeline()
	cmds := make([]*redis.StatusCmd, len(batch))
	bctx := context.WithoutCancel(ctx) // the others' tries do not end with this one's ctx
	for i, t := range batch {
		cmds[i] = pipe.SetArgs(bctx, t.rkey, t.token, redis.SetArgs{Mode: "NX", TTL: t.ttl, Get: true})
	}
	_, _ = pipe.Exec(bctx) // each command carries its own error
	for i, o := range batch {
		// SET NX GET answers nil when it set the key, and the holder's token when not.
		switch holder, err := cmds[i].Result(); {
		case errors.Is(err, redis.Nil):
			o.ok = true
		case err != nil:
			o.err = err
		default:
			o.holder = holder
		}
		if o != t {
			o.wake <- false
		}
	}

	q.mu.Lock()
	if len(q.queue) == 0 {
		q.busy = false
		q.mu.Unlock()
		return t.ok, t.holder, t.err
	}
	next := q.queue
	q.queue = nil
	next[0].lead = next
	q.mu.Unlock()
	next[0].wake <- true
	return t.ok, t.holder, t.err
}

// markWanted queues rkey's wanted mark, and the message that tells the holder's Batcher
// (when holder, its token, names one) that this one waits for it.
func (b *Batcher) markWanted(_ context.Context, rkey, holder string, want time.Duration) {
	b.Send(Call{Script: wantScript, Keys: []string{rkey + wantedSuffix},
		Args: []any{want.Milliseconds(), b.node.channelOf(holder), wantMessage(rkey, b.node.channel)}})
}

// Call is a script call queued on a Batcher (Batcher.Send).
type Call struct {
	Script *redis.Script
	Keys   []string // of one hash slot on a Redis Cluster
	Args   []any

	// Done, when set, is called with the command once its pipeline is back, on the
	// goroutine that sent it (the Batcher's, or a Do caller's): it must be quick and
	// must not wait for the Batcher (it may queue more calls with Send).
	Done func(cmd *redis.Cmd)
}

// Send queues calls to go together in the next pipeline of releases: a goroutine of the
// Batcher sends whatever is queued at once, and what is queued while a pipeline is in
// flight in the next one. Send does not wait for Redis (Wait does). A script is sent by
// EVALSHA, and by EVAL again when Redis does not know it yet.
func (b *Batcher) Send(calls ...Call) {
	w := &b.writes
	w.mu.Lock()
	w.queue = append(w.queue, calls...)
	if !w.running {
		w.running = true
		go b.flush()
	}
	w.mu.Unlock()
}

// Do is Send, and then waits until calls are answered (their Done has run) or ctx ends.
// When no pipeline is in flight, the caller sends it itself, with whatever else is
// queued, and no goroutine of the Batcher takes part.
func (b *Batcher) Do(ctx context.Context, calls ...Call) {
	if len(calls) == 0 {
		return
	}
	done := make(chan struct{})
	left := len(calls)
	var mu sync.Mutex
	for i := range calls {
		then := calls[i].Done
		calls[i].Done = func(cmd *redis.Cmd) {
			if then != nil {
				then(cmd)
			}
			mu.Lock()
			left--
			if left == 0 {
				close(done)
			}
			mu.Unlock()
		}
	}
	w := &b.writes
	w.mu.Lock()
	w.queue = append(w.queue, calls...)
	if w.running {
		w.mu.Unlock()
		select {
		case <-done:
		case <-ctx.Done():
		}
		return
	}
	w.running = true
	batch := w.queue
	w.queue = nil
	w.mu.Unlock()
	b.sendCalls(batch)
	w.mu.Lock()
	if len(w.queue) > 0 {
		go b.flush() // what came meanwhile; running stays set
	} else {
		w.running = false
		w.idle.Broadcast()
	}
	w.mu.Unlock()
}

// Release queues lk's release (Lock.Release) to go with the others; then, when set, is
// called with its outcome (nil, ErrLockLost or a wrapped Redis error) under Call.Done's
// rules. A lock whose TTL has run out by our clock is not
// sent: then gets ErrLockLost at once, on the caller's goroutine.
func (b *Batcher) Release(lk *Lock, then func(err error)) {
	if lk.Remaining() <= 0 {
		if then != nil {
			then(ErrLockLost)
		}
		return
	}
	b.Send(lk.ReleaseCall(then))
}

// ReleaseCall returns the Call that releases the lock, for a caller that sends it with
// its own calls (Batcher.Send); then is as for Batcher.Release.
func (l *Lock) ReleaseCall(then func(err error)) Call {
	c := Call{Script: releaseScript, Keys: []string{l.rkey}, Args: []any{l.token}}
	if then != nil {
		c.Done = func(cmd *redis.Cmd) { then(l.released(cmd)) }
	}
	return c
}

// released reads the answer of release.lua.
func (l *Lock) released(cmd *redis.Cmd) error {
	n, err := cmd.Int64()
	if err != nil {
		return fmt.Errorf("lock: release %q: %w", l.key, err)
	}
	if n != 1 {
		return ErrLockLost
	}
	return nil
}

// Wait returns once every call queued (Send, Release, Obtain's wanted marks) before it,
// and every call their Done queued, has been sent and answered.
func (b *Batcher) Wait() {
	w := &b.writes
	w.mu.Lock()
	defer w.mu.Unlock()
	for w.running {
		w.idle.Wait()
	}
}

// flush sends the queued calls until none is left.
func (b *Batcher) flush() {
	w := &b.writes
	for {
		w.mu.Lock()
		batch := w.queue
		w.queue = nil
		if len(batch) == 0 {
			w.running = false
			w.idle.Broadcast()
			w.mu.Unlock()
			return
		}
		w.mu.Unlock()
		b.sendCalls(batch)
	}
}

// sendCalls sends batch in one pipeline and hands each call its answer.
func (b *Batcher) sendCalls(batch []Call) {
	cmds := runCalls(context.Background(), b.locker.client, batch)
	for i, c := range batch {
		if c.Done != nil {
			c.Done(cmds[i])
		}
	}
}

// runCalls sends calls in one pipeline by EVALSHA. Those that find their script unknown
// (a restarted or flushed Redis) go again, by EVAL for the first of each script and
// EVALSHA for the rest, then by EVAL (a cluster's other nodes).
func runCalls(ctx context.Context, client Client, calls []Call) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(calls))
	pipe := client.Pipeline()
	for i, c := range calls {
		cmds[i] = c.Script.EvalSha(ctx, pipe, c.Keys, c.Args...)
	}
	_, _ = pipe.Exec(ctx)
	for round := range 2 {
		var again []int
		for i, cmd := range cmds {
			if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
				again = append(again, i)
			}
		}
		if len(again) == 0 {
			break
		}
		pipe := client.Pipeline()
		loaded := map[*redis.Script]bool{}
		for _, i := range again {
			c := calls[i]
			if round == 0 && loaded[c.Script] {
				cmds[i] = c.Script.EvalSha(ctx, pipe, c.Keys, c.Args...)
				continue
			}
			loaded[c.Script] = true
			cmds[i] = c.Script.Eval(ctx, pipe, c.Keys, c.Args...)
		}
		_, _ = pipe.Exec(ctx)
	}
	return cmds
}

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
