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
