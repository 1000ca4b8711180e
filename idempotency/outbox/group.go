package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency/internal/commit"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// Concurrent Enqueue calls share transactions: each round records every queued intent
// in one multi-row statement and one commit (see commit.Committer), and the intents a
// round recorded are then published together, up to publishers at once. At low load a
// round carries one call and adds no wait.

// enqueueOp is one Enqueue call in a round.
type enqueueOp struct {
	spec Spec
	span trace.Span // its caller's
	res  EnqueueResult
	err  error // its own outcome (a mismatch); the round's is Run's
}

// publishOp is one new intent to publish at once, in a round with others.
type publishOp struct {
	spec      Spec
	published bool
}

// commitResolveFor bounds how long a round whose COMMIT lost its answer asks the server
// what became of it before it reports ErrCommitUnknown (groupcommit.ErrCommitUnknown).
const commitResolveFor = 5 * time.Second

func (c *Client) newCommitters() {
	c.enq = commit.New(commit.Config[*enqueueOp]{
		Lanes:     1,
		Workers:   c.cfg.Committers,
		MaxBatch:  c.cfg.MaxBatch,
		Timeout:   c.cfg.WriteTimeout,
		Key:       func(op *enqueueOp) string { return op.spec.Key },
		Send:      c.sendEnqueues,
		Refused:   Refused,
		Retryable: pgconn.SafeToRetry,
	})
	c.pub = commit.New(commit.Config[*publishOp]{
		Lanes:     1,
		Workers:   c.cfg.Committers,
		MaxBatch:  c.cfg.RelayBatch,
		Timeout:   c.cfg.WriteTimeout,
		Key:       func(op *publishOp) string { return op.spec.Key },
		Send:      c.sendPublishes,
		Refused:   func(error) bool { return false },
		Retryable: func(error) bool { return false },
	})
}

// Refused reports an error with which the server refused a shared round because of one
// of its rows (a constraint, a lock it waited too long for, a deadlock): the round is
// then sent again in halves, down to the row at fault. A cancelled statement (the
// statement timeout of a stalled server) or a broken connection is no row's fault.
func Refused(err error) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return false
	}
	switch {
	case pe.Code == store.QueryCanceled, strings.HasPrefix(pe.Code, "08"), strings.HasPrefix(pe.Code, "57"), strings.HasPrefix(pe.Code, "53"):
		return false
	}
	return true
}

// sendEnqueues records one round's intents in a transaction of its own. A round that two
// or more traced callers share is a span of its own, idemq.enqueue (see commit.StartSpan).
func (c *Client) sendEnqueues(ctx context.Context, batches [][]*enqueueOp) (err error) {
	ops := batches[0]
	specs := make([]Spec, len(ops))
	var traced commit.SpanMembers
	for i, op := range ops {
		specs[i], op.res, op.err = op.spec, EnqueueResult{}, nil
		traced.Add(op.span)
	}
	if span := commit.StartSpan(c.tracer, "idemq.enqueue", len(ops), traced); span != nil {
		defer func() { commit.EndSpan(span, err) }()
	}
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	var id store.XactID
	if err := tx.QueryRow(ctx, store.XactIDSQL).Scan(&id.Xid, &id.ServerStart); err != nil {
		return err
	}
	res, errs, err := enqueueMany(ctx, pgxIntents{tx}, specs, c.cfg.RelayHold)
	if err != nil {
		return err
	}
	if err := store.CommitXact(ctx, tx, c.pool, id, commitResolveFor); err != nil {
		return err
	}
	for i, op := range ops {
		op.res, op.err = res[i], errs[i]
	}
	return nil
}

// sendPublishes publishes one round's new intents. It does not take them from the relays
// first (one statement less per intent): a relay that publishes one of them at the same
// time meets its TaskID in Redis, which counts as published (see publish).
func (c *Client) sendPublishes(ctx context.Context, batches [][]*publishOp) error {
	ops := batches[0]
	rows := make([]intentRow, len(ops))
	now := time.Now()
	for i, op := range ops {
		rows[i] = intentRow{spec: op.spec, createdAt: now, publishedAt: now}
	}
	done, err := c.publishRows(ctx, rows)
	published := make(map[string]bool, len(done))
	for _, k := range done {
		published[k] = true
	}
	for _, op := range ops {
		op.published = published[op.spec.Key]
	}
	return err
}

// Enqueue records spec's intent, in a transaction shared with concurrent calls, and
// publishes it at once (a relay publishes it later if that fails: the result's State then
// says pending). Duplicates and mismatches are reported as by EnqueueTx. A commit whose
// answer was lost is resolved by transaction id; when it cannot be, the error wraps
// groupcommit.ErrCommitUnknown and the intent may or may not be recorded: enqueue it
// again (the same spec is then a duplicate, never a second job).
func (c *Client) Enqueue(ctx context.Context, spec Spec) (EnqueueResult, error) {
	if err := checkSpec(spec); err != nil {
		return EnqueueResult{}, err
	}
	spec = withTrace(ctx, spec)
	op := &enqueueOp{spec: spec, span: trace.SpanFromContext(ctx)}
	if err := c.enq.Run(ctx, 0, op); err != nil {
		return EnqueueResult{}, fmt.Errorf("outbox: record intent %s: %w", spec.Key, err)
	}
	if op.err != nil {
		return EnqueueResult{}, op.err
	}
	res := op.res
	if res.Duplicate || res.State != IntentPending {
		// A duplicate's intent is the relays' to publish, under its own publish
		// generation: pending after an operator's rerun, it is not generation 0.
		return res, nil
	}
	if c.Publish(ctx, spec) {
		res.State = IntentPublished
	}
	return res, nil
}

// Publish publishes the intent of spec, which a transaction that committed recorded as
// new (EnqueueTx or EnqueueManyTx said pending, not duplicate), in a round with
// concurrent calls, instead of waiting for a relay, and reports whether it did. A failure
// is logged and left to the relays.
func (c *Client) Publish(ctx context.Context, spec Spec) bool {
	op := &publishOp{spec: spec.withDefaults()}
	if err := c.pub.Run(ctx, 0, op); err != nil {
		c.log.Warn("publish at enqueue failed; a relay will retry", "key", spec.Key, "err", err)
	}
	return op.published
}
