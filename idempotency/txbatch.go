package idempotency

import (
	"context"
	"encoding/json"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/idempotency/internal/txshim"
)

// txBatchBudget is how long a shared transaction runs its members' handlers: the members
// still waiting when it is spent give their claims back (in the finish) and run in
// transactions of their own, in parallel. Sharing pays when handlers take about as long
// as a claim and a commit; a handler that sleeps or waits on a slow query would otherwise
// hold up every member after it.
const txBatchBudget = 5 * time.Millisecond

// txSavepointsFor is how long shared transactions give each member a savepoint after one
// that ran its members without savepoints rolled back (a handler failed, or the finish was
// refused): a steady rate of business errors must not run every handler twice.
const txSavepointsFor = 5 * time.Second

// txSlowTurn is the average member's turn (its handler and its round trips) above which a
// shared transaction past its budget gives its remaining members back.
const txSlowTurn = time.Millisecond

// txSlowHandler is the average handler time outside the database (txshim.Tx.InDB) above
// which DoTx deliveries stop sharing transactions and run alone, in parallel, until
// handlers are quick again.
const txSlowHandler = time.Millisecond

// handlerTimes is a moving average of a duration.
type handlerTimes struct{ nanos atomic.Int64 }

// record adds a handler's run time to the moving average (weight 1/8).
func (h *handlerTimes) record(d time.Duration) {
	for {
		old := h.nanos.Load()
		if h.nanos.CompareAndSwap(old, old+(int64(d)-old)/8) {
			return
		}
	}
}

// slow reports whether handlers take longer than limit, on average.
func (h *handlerTimes) slow(limit time.Duration) bool { return time.Duration(h.nanos.Load()) > limit }

// fit is how many members fit in budget, at the average time, within 2..most: never
// one, as only a transaction of several members measures a member's turn, and a
// transaction whose second member does not fit gives it back. (A member given back costs
// a claim and a finish for nothing: the estimate does not round up.)
func (h *handlerTimes) fit(budget time.Duration, most int) int {
	avg := time.Duration(h.nanos.Load())
	if avg <= 0 {
		return most
	}
	return max(min(2, most), min(most, int(budget/avg)))
}

// txMember is one DoTx delivery in a transaction: shared (it waits in Ledger.txq and its
// own goroutine runs fn when the executor hands it the transaction) or alone (local: the
// caller's goroutine is the executor and runs fn itself). It carries its caller's ctx,
// as an http.Request does, so that the executor can tell at the member's turn whether the
// caller still waits.
type txMember struct {
	ctx   context.Context
	req   Request
	fn    func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) // local members only
	round int                                                           // claim rounds before this one
	// timed: fn's run time joins the moving average (Ledger.txTimes). Shared members and
	// deliveries run alone because handlers are slow are timed, so that the average can
	// come down again; a member given back by a shared transaction (past its budget, or
	// after a lost race) is not: its run alone says nothing of how sharing goes.
	timed bool

	run    chan txTurn   // executor → member: the claim is taken, run fn
	ran    chan txRan    // member → executor: fn returned or panicked
	answer chan txAnswer // executor → member: the outcome (buffered)

	// The executor's own.
	answered bool
	claim    *Claim
	res      Result
	finish   txFinish
	later    bool // did not run in the batch (past txBatchBudget): runs alone after it
	panicked bool // a local fn panicked with pval: the caller panics again
	pval     any
}

// newTxMember returns the member of a delivery: local (fn set, run by its executor) or
// shared (fn nil; the hand-over channels carry its turn).
func newTxMember(ctx context.Context, req Request, fn func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error)) *txMember {
	m := &txMember{ctx: ctx, req: req, fn: fn, answer: make(chan txAnswer, 1)}
	if fn == nil {
		m.run, m.ran = make(chan txTurn, 1), make(chan txRan, 1)
	}
	return m
}

type txTurn struct {
	tx *txshim.Tx
	c  *Claim
}

type txRan struct {
	out      json.RawMessage
	err      error
	panicked bool
	own      time.Duration // fn's run less what it waited on the database
}

type txAnswer struct {
	res   Result
	err   error
	stuck int64 // a fence to mark needs_attention
	lost  error // the commit's answer was lost: resolve it from the transaction id
	// alone: the shared claim could not decide this member (a lost race, or a batch the
	// server refused): it runs in a transaction of its own instead.
	alone bool
	// recorded: a permanent failure was committed with the batch (no recordPermanent).
	recorded bool
}

// finish is what the shared finish does with a claimed member's row.
type txFinish struct {
	action store.Action // complete, store (complete with result), fail (permanent) or forget (the handler failed)
	result pgtype.Text  // store: the result
	errMsg pgtype.Text
	err    error // the handler's error, answered after the commit (fail)
}

// runTxBatches is an executor: it runs the queued deliveries in shared transactions on
// one connection, up to Config.MaxBatch (one per key, in key order) in each, until
// nothing is queued. Up to 2 × Config.Committers executors run at once.
func (l *Ledger) runTxBatches() {
	var conn *pgxpool.Conn
	defer func() {
		if conn != nil {
			conn.Release()
		}
	}()
	for {
		// Take the connection first, so that members stay free to leave meanwhile.
		var acqErr error
		if conn == nil && l.txq.Ready() {
			conn, acqErr = l.acquireTxConn()
		}
		batches := l.txq.Take(l.memberTimes.fit(l.txBudget, l.cfg.MaxBatch))
		if batches == nil {
			return
		}
		ms := batches[0]
		if conn == nil && acqErr == nil {
			conn, acqErr = l.acquireTxConn()
		}
		if acqErr != nil {
			for _, m := range ms {
				m.answer <- txAnswer{err: fmt.Errorf("idempotency: claim %s: %w", m.req.Key, acqErr)}
			}
			l.txq.Done(batches)
			continue
		}
		l.observeBatch(BatchTx, len(ms))
		if !l.runTxBatch(conn.Conn(), ms) {
			conn.Release() // the pool closes a connection left in a transaction
			conn = nil
		}
		l.txq.Done(batches)
	}
}

func (l *Ledger) acquireTxConn() (*pgxpool.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.WriteTimeout)
	defer cancel()
	return l.pool.Acquire(ctx)
}

// txBatch is the state of one transaction, used by its executor only: one multi-row
// claim for every member (store.BeginClaims), each claimed member's handler, and one
// multi-row finish that completes, fails or forgets every claimed row, with the COMMIT
// (store.FinishAndCommit). With several members claimed, each handler runs in a savepoint
// of its own (made when it first uses the transaction); a member claimed alone needs
// none: its failure rolls the whole transaction back.
type txBatch struct {
	l    *Ledger
	conn *pgx.Conn
	idle string // idle_in_transaction_session_timeout for the whole transaction

	xid, serverStart string // the transaction's id, drawn with the claims

	pre     []string    // statements sent ahead of the next round trip (a RELEASE)
	claimed []*txMember // members whose rows the finish ends, in order
	broken  error       // the transaction cannot commit
	// optimistic: the members run without savepoints, their results stored by the finish;
	// undone: one of them failed, so the transaction rolls back and every member runs
	// alone (its outcome then is its outcome alone).
	optimistic, undone bool
}

// ctx bounds one round trip of the executor: a claim's lock wait and a write.
func (b *txBatch) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), b.l.cfg.WriteTimeout+b.l.cfg.ClaimLockTimeout)
}

func (b *txBatch) replyWith(m *txMember, a txAnswer) {
	if m.answered {
		return
	}
	m.answered = true
	m.answer <- a
}

// rollback ends the transaction (or closes the connection).
func (b *txBatch) rollback() {
	ctx, cancel := b.ctx()
	defer cancel()
	store.Rollback(ctx, b.conn)
}

// runTxBatch runs ms, sorted by key, in one transaction on conn, and answers each. It
// reports whether conn is fit for another batch.
func (l *Ledger) runTxBatch(conn *pgx.Conn, ms []*txMember) bool {
	// The transaction lives across its members: its idle timeout is the longest any
	// member allows, so no member's short deadline cuts the others off.
	var latest time.Time
	for _, m := range ms {
		if m.req.Deadline.IsZero() {
			latest = time.Time{}
			break
		}
		if m.req.Deadline.After(latest) {
			latest = m.req.Deadline
		}
	}
	b := &txBatch{l: l, conn: conn, idle: l.idleTimeout(latest)}
	switch {
	case !b.claimAll(ms):
		// Nothing claimed (completed keys, busy ones, races): the transaction wrote
		// nothing; end it so that the connection goes back to the pool (or on to the next
		// batch) instead of being closed for a transaction left open.
		if b.broken == nil {
			b.rollback()
		}
	case len(b.claimed) == 1:
		b.runSolo(b.claimed[0])
	default:
		b.optimistic = time.Now().UnixNano() >= l.savepointsUntil.Load()
		start := time.Now()
		ran := 0
		for _, m := range b.claimed {
			if b.broken != nil || b.undone {
				break
			}
			if spent := time.Since(start); spent > l.txBudget && spent > time.Duration(ran)*txSlowTurn {
				// Handlers this slow gain nothing from sharing a connection: the rest
				// give their claims back and run alone, side by side. (Quick turns that
				// only add up past the budget, as on a loaded machine, keep their places:
				// a claim given back is a claim and a commit more.)
				m.finish, m.later = txFinish{action: store.ActionForget}, true
				l.observe(EventGivenBack, m.req.TaskType)
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
			// A member's turn costs its handler and the round trips around it (its
			// savepoint, its result): a shared transaction takes only as many members as
			// fit in the budget at that cost, so that it gives none back.
			l.memberTimes.record(time.Since(start) / time.Duration(ran))
		}
		if b.broken == nil && !b.undone {
			b.commit()
		}
		if b.undone && b.broken == nil {
			b.rollback()
			b.rerunAlone()
		}
	}
	if b.broken != nil {
		for _, m := range ms {
			b.replyWith(m, txAnswer{err: fmt.Errorf("idempotency: DoTx %s: the transaction did not commit; nothing recorded: %w", m.req.Key, b.broken)})
		}
		b.rollback()
	}
	return !conn.IsClosed() && conn.PgConn().TxStatus() == 'I'
}
