package groupcommit

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency/internal/commit"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// Config describes a Committer.
type Config[T any] struct {
	// Workers caps the rounds in flight at once; MaxBatch caps the requests of each.
	Workers, MaxBatch int
	// Timeout bounds each attempt to send a round.
	Timeout time.Duration
	// Keys are a request's keys (the first orders a round): a round carries each key at
	// most once, and a request whose key its round already holds waits for the next.
	// Rounds in flight at once may share a key: the database's row locks order them.
	Keys func(T) []string
	// Send sends one round's requests, in key order, in one transaction and returns its
	// error, nil once it committed (see Commit). A request's own outcome is the caller's
	// to record in T.
	Send func(ctx context.Context, round []T) error
	// Refused reports whether the server refused a round because of one of its requests
	// (a constraint, a lock it waited too long for; nothing committed): the round is then
	// sent again in halves, down to that request. Retryable reports an error with which
	// nothing reached the server (a connection from before a restart): the round is sent
	// once more. Nil means never.
	Refused, Retryable func(error) bool
	// Tracer, when set, makes a round that two or more recording callers share a span of
	// its own, named SpanName: a root linked to each caller's span (from Run's ctx), each
	// of which links back to it.
	Tracer   trace.Tracer
	SpanName string
}

// Committer commits the requests of many concurrent callers together. Up to
// Config.Workers goroutines each take whatever is queued when they start a round (no
// timer: at low load a round carries one request and adds no latency). It is safe for
// concurrent use.
type Committer[T any] struct {
	cfg Config[T]
	c   *commit.Committer[*request[T]]
}

// request is one caller's request with its caller's span.
type request[T any] struct {
	v    T
	span trace.Span
}

// New returns a Committer for cfg.
func New[T any](cfg Config[T]) *Committer[T] {
	never := func(error) bool { return false }
	refused, retryable := cfg.Refused, cfg.Retryable
	if refused == nil {
		refused = never
	}
	if retryable == nil {
		retryable = never
	}
	gc := &Committer[T]{cfg: cfg}
	gc.c = commit.New(commit.Config[*request[T]]{
		Lanes:     1,
		Workers:   cfg.Workers,
		MaxBatch:  cfg.MaxBatch,
		Timeout:   cfg.Timeout,
		Keys:      func(r *request[T]) []string { return cfg.Keys(r.v) },
		RoundOnly: true,
		Send:      gc.send,
		Refused:   refused,
		Retryable: retryable,
	})
	return gc
}

// Run queues v and waits until its round committed or failed, returning the round's
// error. A caller whose ctx ends while v is still queued leaves with ctx's error; once
// sent, v's outcome is awaited (each attempt is bounded by Config.Timeout).
func (c *Committer[T]) Run(ctx context.Context, v T) error {
	return c.c.Run(ctx, 0, &request[T]{v: v, span: trace.SpanFromContext(ctx)})
}

func (c *Committer[T]) send(ctx context.Context, batches [][]*request[T]) (err error) {
	reqs := batches[0]
	round := make([]T, len(reqs))
	var traced commit.SpanMembers
	for i, r := range reqs {
		round[i] = r.v
		traced.Add(r.span)
	}
	if span := commit.StartSpan(c.cfg.Tracer, c.cfg.SpanName, len(reqs), traced); span != nil {
		defer func() { commit.EndSpan(span, err) }()
	}
	return c.cfg.Send(ctx, round)
}

// ErrCommitUnknown means a COMMIT lost its answer and the server could not say whether it
// committed (it restarted as another server, or stayed unreachable). The outbox's
// Enqueue reports it too (wrapped).
var ErrCommitUnknown = store.ErrCommitUnknown

// TxIDSQL reads a transaction's id and the server's start time, into a TxID's Xid and
// ServerStart; send it inside the transaction (it assigns the id), pipelined with the
// first statements.
var TxIDSQL = store.XactIDSQL

// TxID names a transaction on one server run (read with TxIDSQL).
type TxID struct {
	Xid, ServerStart string
}

// Commit commits tx. When the server answered the COMMIT with an error, nothing
// committed. When the answer was lost, Commit asks the server on fresh connections from
// pool, for up to resolveFor, whether transaction id committed: nil if it did, an error
// if it aborted, and ErrCommitUnknown (wrapped) if that cannot be learned. An id with no
// Xid is not resolved: a lost answer is then returned as it is.
func Commit(ctx context.Context, tx pgx.Tx, pool *pgxpool.Pool, id TxID, resolveFor time.Duration) error {
	return store.CommitXact(ctx, tx, pool, store.XactID(id), resolveFor)
}
