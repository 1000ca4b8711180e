package commit

import (
	"context"
	"time"
)

// Config describes a Committer.
type Config[T comparable] struct {
	// Lanes is how many kinds of request a round carries side by side; Send gets a batch
	// for each, in this order.
	Lanes int
	// Workers caps the rounds in flight at once; MaxBatch caps each lane of a round.
	Workers, MaxBatch int
	// Inline sends every request alone, on its caller's goroutine: a batch of one, on the
	// same path.
	Inline bool
	// Timeout bounds each attempt to send a round.
	Timeout time.Duration
	// Key is a request's key: one round carries a key at most once per lane. Keys, when
	// set instead, gives a request several (the first orders a batch): one round carries
	// each at most once per lane.
	Key  func(T) string
	Keys func(T) []string
	// RoundOnly keeps keys apart within a round only: rounds in flight may share one.
	RoundOnly bool
	// Send sends the batches (batches[i] is lane i's, sorted by key; some are empty) in
	// one transaction and returns its error, nil once it committed.
	Send func(ctx context.Context, batches [][]T) error
	// Refused reports whether the server refused a round (nothing committed): it is then
	// sent again one lane at a time, and a lane's batch in halves, down to the request at
	// fault. Retryable reports an error that nothing reached the server with: the round is
	// sent once more.
	Refused, Retryable func(error) bool
	// Observe, if set, gets the size of each lane's batch in each round.
	Observe func(lane, size int)
}

// Committer commits the requests of many concurrent callers together. A caller queues
// its request and waits. Up to Workers goroutines each take whatever is queued when they
// start a round (no timer: at low load a round carries one request and adds no latency)
// and send it with Config.Send. Each request gets its own round's error, and none is
// answered before its round ended.
type Committer[T comparable] struct {
	cfg Config[T]
	q   *Queue[*waiter[T]]
}

type waiter[T any] struct {
	v    T
	done chan struct{}
	err  error
}

// New returns a Committer for cfg.
func New[T comparable](cfg Config[T]) *Committer[T] {
	c := &Committer[T]{cfg: cfg}
	keys := cfg.Keys
	if keys == nil {
		keys = func(v T) []string { return []string{cfg.Key(v)} }
	}
	c.q = NewQueueKeys(cfg.Lanes, cfg.Workers, 0, func(w *waiter[T]) []string { return keys(w.v) }, cfg.RoundOnly)
	return c
}

// Run queues v in lane and waits until its round committed or failed, returning the
// round's error. A caller whose ctx ends while v is still queued leaves with ctx's error;
// once sent, v's outcome is awaited (each attempt is bounded by Config.Timeout).
func (c *Committer[T]) Run(ctx context.Context, lane int, v T) error {
	w := &waiter[T]{v: v, done: make(chan struct{})}
	if c.cfg.Inline {
		batches := make([][]*waiter[T], c.cfg.Lanes)
		batches[lane] = []*waiter[T]{w}
		c.commitLane(ctx, batches, lane)
		return w.err
	}
	if c.q.Push(lane, w) {
		go c.loop()
	}
	select {
	case <-w.done:
		return w.err
	case <-ctx.Done():
	}
	if c.q.Leave(lane, w) {
		return context.Cause(ctx)
	}
	<-w.done
	return w.err
}

// loop sends rounds until nothing it may take is queued.
func (c *Committer[T]) loop() {
	for {
		batches := c.q.Take(c.cfg.MaxBatch)
		if batches == nil {
			return
		}
		c.commitRound(batches)
		for lane, b := range batches {
			if len(b) > 0 && c.cfg.Observe != nil {
				c.cfg.Observe(lane, len(b))
			}
		}
		c.q.Done(batches)
		for _, b := range batches {
			for _, w := range b {
				close(w.done)
			}
		}
	}
}

// commitRound commits every lane's batch in one transaction, setting each request's
// error; if the server refuses the round, each lane is committed on its own.
func (c *Committer[T]) commitRound(batches [][]*waiter[T]) {
	var lanes []int
	for lane, b := range batches {
		if len(b) > 0 {
			lanes = append(lanes, lane)
		}
	}
	if len(lanes) == 1 {
		c.commitLane(context.Background(), batches, lanes[0])
		return
	}
	err := c.send(context.Background(), batches)
	if err != nil && c.cfg.Refused(err) {
		for _, lane := range lanes {
			only := make([][]*waiter[T], len(batches))
			only[lane] = batches[lane]
			c.commitLane(context.Background(), only, lane)
		}
		return
	}
	for _, b := range batches {
		for _, w := range b {
			w.err = err
		}
	}
}

// commitLane commits batches, which hold lane's batch alone, setting each request's
// error; when the server refused it, each half is committed on its own.
func (c *Committer[T]) commitLane(ctx context.Context, batches [][]*waiter[T], lane int) {
	err := c.send(ctx, batches)
	if b := batches[lane]; err != nil && len(b) > 1 && c.cfg.Refused(err) {
		half := len(b) / 2
		for _, part := range [][]*waiter[T]{b[:half], b[half:]} {
			only := make([][]*waiter[T], len(batches))
			only[lane] = part
			c.commitLane(ctx, only, lane)
		}
		return
	}
	for _, w := range batches[lane] {
		w.err = err
	}
}

// send sends one round, and once more when nothing reached the server (a connection left
// over from before a restart).
func (c *Committer[T]) send(ctx context.Context, batches [][]*waiter[T]) error {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	vs := make([][]T, len(batches))
	for i, b := range batches {
		for _, w := range b {
			vs[i] = append(vs[i], w.v)
		}
	}
	err := c.cfg.Send(ctx, vs)
	if err != nil && c.cfg.Retryable(err) {
		err = c.cfg.Send(ctx, vs)
	}
	return err
}

// Round commits batches (lane i's in batches[i], each sorted by key) as one round on the
// caller's goroutine, as a worker does, and returns each request's error, by lane and
// position.
func (c *Committer[T]) Round(batches [][]T) [][]error {
	ws := make([][]*waiter[T], len(batches))
	for i, b := range batches {
		for _, v := range b {
			ws[i] = append(ws[i], &waiter[T]{v: v})
		}
	}
	c.commitRound(ws)
	errs := make([][]error, len(ws))
	for i, b := range ws {
		for _, w := range b {
			errs[i] = append(errs[i], w.err)
		}
	}
	return errs
}
