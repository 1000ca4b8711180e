package sharedtx

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemq/idemq/idempotency/internal/claimctx"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// A member of a batch: its handler's turn in the shared transaction, and its outcome.

// runShared runs the claimed members one after another, within the budget, and commits
// them (or, undone, rolls back and has them run alone).
func (b *batch) runShared() {
	e := b.e
	b.optimistic = e.Optimistic()
	start := time.Now()
	ran := 0
	for _, m := range b.claimed {
		if b.broken != nil || b.undone {
			break
		}
		if b.own > e.Budget || time.Since(start) > e.Budget*wallBudgets {
			// Handlers this slow gain nothing from sharing a connection: the rest give
			// their claims back and run alone, side by side. What counts is the handlers'
			// own time, outside the database: on a saturated machine every turn takes
			// longer (a round trip and two wake-ups, each waiting for a core), which is
			// when sharing matters most, and a claim given back is a claim and a commit
			// more. Only a transaction that has run several budgets' worth of turns (a
			// handler waiting on a slow query) gives its rest back for its wall time.
			m.later = true
			e.observe(EventGivenBack, m)
			continue
		}
		if b.optimistic {
			b.runOptimistic(m)
		} else {
			b.runMember(m)
		}
		ran++
	}
	if ran > 0 {
		// A member's turn costs its handler and the round trips around it (its savepoint,
		// its result): a shared transaction takes only as many members as fit in the
		// budget at that cost, so that it gives none back.
		e.turns.record(time.Since(start) / time.Duration(ran))
	}
	if b.broken == nil && !b.undone {
		b.commit()
	}
	if b.undone && b.broken == nil {
		b.rollback()
		b.rerunAlone()
	}
}

// runOptimistic runs m's fn on the shared transaction without a savepoint: its result is
// stored by the finish. A handler that fails (or panics, or leaves the transaction
// aborted) undoes the whole transaction; every member then runs alone, a panicking one
// panics again.
func (b *batch) runOptimistic(m *member) {
	r, ok := b.turn(m, nil)
	switch {
	case !ok:
	case r.panicked:
		b.undone = true
		b.reply(m, nil) // the member panics again
	case r.err != nil:
		b.undone = true
	default:
		b.complete(m, r.out)
	}
}

// runMember runs m's fn on the shared transaction. The member's savepoint is made when fn
// first uses the transaction; it is released when fn succeeds and the server takes its
// result (its row is written by the finish) and rolled back when fn fails (its row is not
// written, or written failed).
func (b *batch) runMember(m *member) {
	saved := false
	r, ok := b.turn(m, func(ctx context.Context) error {
		saved = true
		return store.OpenSavepoint(ctx, b.conn, b.takePre())
	})
	if !ok {
		return
	}
	var rej *pgconn.PgError // the server refused the result
	if r.err == nil && !r.panicked {
		b.complete(m, r.out)
		var err error
		if m.out.Stored.Valid {
			// The server parses the result while the savepoint still holds the effect: a
			// value jsonb refuses rolls back this member alone, not the whole transaction.
			var pre []string
			if !saved {
				saved = true
				pre = store.WithSavepoint(b.takePre())
			}
			ctx, cancel := b.ctx()
			err = store.CheckResult(ctx, b.conn, pre, m.out.Stored.String)
			cancel()
		}
		switch {
		case err == nil:
			if saved {
				b.pre = store.WithRelease(b.pre)
			}
			return
		case !errors.As(err, &rej):
			b.broken = own(err)
			b.reply(m, b.broken)
			return
		}
		m.finish, m.out.Refused = finish{}, rej
	}
	// fn failed: its effect goes with its savepoint.
	if saved {
		ctx, cancel := b.ctx()
		err := store.UndoSavepoint(ctx, b.conn)
		cancel()
		if err != nil {
			b.broken = own(err)
			b.reply(m, errors.Join(r.err, b.broken))
			return
		}
	}
	switch {
	case r.panicked:
		b.reply(m, nil) // the member panics again
	case rej != nil && rej.Code[:2] == store.DataExceptionClass:
		// A result jsonb refuses is recorded for good, with the commit.
		m.finish = failed(refusedResult+rej.Message, nil)
	case rej != nil:
		b.reply(m, nil)
	case b.e.cfg.Permanent(r.err):
		// Answered with the commit, which records the failure.
		m.finish = failed(r.err.Error(), r.err)
	default:
		b.reply(m, r.err) // no row: the next delivery runs it
	}
}

// turn hands the transaction to m's fn, as a pgx.Tx whose first use runs first (nil:
// none), on this goroutine for a local member, else on m's own, and checks the
// transaction after it. ok is false when m is answered already: its caller ended, or its
// handler broke the transaction (the connection closed or busy, the transaction neither
// open nor aborted), which breaks the batch. A handler that succeeded but left the
// transaction aborted gets that as its error: nothing of it is recorded.
//
// A timed member's time outside the database joins the moving average that decides
// whether deliveries share transactions: on a saturated machine every query takes
// longer, which is when sharing matters most, so the database's time is no reason to
// stop.
func (b *batch) turn(m *member, first func(ctx context.Context) error) (r ran, ok bool) {
	m.finish = finish{}
	if err := m.ctx.Err(); err != nil {
		b.reply(m, fmt.Errorf("idempotency: DoTx %s: %w", m.d.Key, err))
		return r, false
	}
	if b.optimistic {
		b.e.observe(EventSharedRun, m)
	}
	// The handler runs here, on the goroutine that owns the transaction: its caller
	// waits for the outcome (Exec.await) and panics again there if it panicked.
	r = m.runFn(newHandlerTx(b.conn, first))
	if m.timed {
		b.e.handlers.record(r.own)
	}
	b.own += r.own
	pc := b.conn.PgConn()
	st := pc.TxStatus()
	if b.conn.IsClosed() || pc.IsBusy() || st != 'T' && st != 'E' {
		b.broken = fmt.Errorf("idempotency: DoTx %s: the handler ended or broke the transaction (status %q)", m.d.Key, st)
		b.reply(m, errors.Join(r.err, b.broken))
		return r, false
	}
	if r.err == nil && !r.panicked && st != 'T' {
		r.err = fmt.Errorf("idempotency: DoTx %s: the handler ended or broke the transaction (status %q); nothing recorded", m.d.Key, st)
	}
	return r, true
}

// complete has the finish write m's row completed with out, checked (store.ResultText):
// the result itself, or an error marker in its place.
func (b *batch) complete(m *member, out []byte) {
	m.out.Out = out
	m.out.Stored, m.out.LastErr = store.ResultText(out, b.e.cfg.MaxResultBytes)
	if m.out.LastErr.Valid {
		b.e.observe(EventBadResult, m)
	}
	m.finish = finish{action: store.ActionComplete}
}

// member is one delivery in a transaction: shared (it waits in Exec.q, and the executor
// runs its fn on the transaction at its turn) or local (alone: the caller's goroutine is
// the executor). Either way fn runs on the goroutine that owns the transaction. It carries its caller's ctx,
// as an http.Request does, so that the executor can tell at the member's turn whether the
// caller still waits.
type member struct {
	ctx   context.Context
	d     Delivery
	local bool
	round int // claim rounds before this one
	// timed: fn's run time joins the moving average (Exec.handlers). Shared members and
	// deliveries run alone because handlers are slow are timed, so that the average can
	// come down again; a member given back by a shared transaction (past its budget, or
	// after a lost race) is not: its run alone says nothing of how sharing goes.
	timed bool
	scope string // its scope's line, when it waits in one (Exec.scoped)

	answer chan Outcome // executor → member: the outcome (buffered)

	// The executor's own.
	out      Outcome // the outcome so far, of this claim round
	answered bool
	requeue  bool // back to the head of its scope's line after the batch (batch.again)
	finish   finish
	later    bool // did not run in the batch (past Budget): runs alone after it
	panicked bool // fn panicked with pval: the caller panics again
	pval     any
}

// newMember returns the member of a delivery, local or shared.
func newMember(ctx context.Context, d Delivery, local bool) *member {
	return &member{ctx: ctx, d: d, local: local, answer: make(chan Outcome, 1)}
}

type ran struct {
	out      json.RawMessage
	err      error
	panicked bool
	own      time.Duration // fn's run less what it waited on the database
}

// finish is what the finish writes for a claimed member: its row completed with its
// result, or failed (permanent); none (action "") when its handler failed otherwise.
type finish struct {
	action store.Action // complete or fail
	errMsg pgtype.Text
	err    error // the handler's error, answered after the commit (fail)
}

// refusedResult begins the recorded error of a result jsonb refuses.
const refusedResult = "idempotency: result refused by the database: "

// failed is the finish that records a permanent failure, msg (cleaned) as its last error;
// err is answered after the commit.
func failed(msg string, err error) finish {
	return finish{action: store.ActionFail, errMsg: pgtype.Text{String: store.CleanText(msg), Valid: true}, err: err}
}

// runFn runs m's fn on tx, in ctx carrying the claim, recovering a panic (its value is
// m.pval).
func (m *member) runFn(tx *handlerTx) (r ran) {
	began := time.Now()
	defer func() {
		r.own = time.Since(began) - tx.InDB()
		if p := recover(); p != nil {
			r.panicked, m.panicked, m.pval = true, true, p
		}
	}()
	r.out, r.err = m.d.Fn(claimctx.WithTx(m.ctx, m.d.Key, m.out.Row.Fence.Int64), tx)
	return r
}
