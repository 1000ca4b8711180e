package sharedtx

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency/internal/sharedspan"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// batch is the state of one transaction, used by its executor only: the members' keys
// held and read in its first round trip (Writes.BeginClaims), each claimed member's
// handler, and one multi-row finish that writes every completed or failed member's row,
// with the COMMIT (Writes.FinishAndCommit). With several members claimed, each handler
// runs in a savepoint of its own (made when it first uses the transaction) unless the
// transaction is optimistic; a member claimed alone needs none: its failure rolls the
// whole transaction back. A member that failed leaves no row (a permanent failure: a
// failed one).
type batch struct {
	e    *Exec
	conn *pgx.Conn
	idle string // idle_in_transaction_session_timeout for the whole transaction

	xid, serverStart string // the transaction's id, drawn with the claims

	shared  bool          // run by an executor of the queue (runBatches), not by a caller alone
	pre     []string      // statements sent ahead of the next round trip (a RELEASE)
	own     time.Duration // the members' handlers' time outside the database so far
	claimed []*member     // members whose rows the finish ends, in order
	broken  error         // the transaction cannot commit
	// optimistic: the members run without savepoints, their results stored by the finish;
	// undone: one of them failed, so the transaction rolls back and every member runs
	// alone (its outcome then is its outcome alone).
	optimistic, undone bool
}

// ctx bounds one round trip of the executor: a claim's lock wait and a write.
func (b *batch) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), b.e.cfg.WriteTimeout+b.e.cfg.ClaimLockTimeout)
}

func (b *batch) replyWith(m *member, a Answer) {
	if m.answered {
		return
	}
	m.answered = true
	m.answer <- a
}

// rollback ends the transaction (or closes the connection).
func (b *batch) rollback() {
	ctx, cancel := b.ctx()
	defer cancel()
	store.Rollback(ctx, b.conn)
}

// runBatch runs ms, sorted by key, in one transaction on conn, and answers each. It
// reports whether conn is fit for another batch.
func (e *Exec) runBatch(conn *pgx.Conn, ms []*member, shared bool) bool {
	// The transaction lives across its members: its idle timeout is the longest any
	// member allows, so no member's short deadline cuts the others off.
	var latest time.Time
	for _, m := range ms {
		dl := m.d.Deadline()
		if dl.IsZero() {
			latest = time.Time{}
			break
		}
		if dl.After(latest) {
			latest = dl
		}
	}
	b := &batch{e: e, conn: conn, idle: e.idleTimeout(latest), shared: shared}
	if span := e.batchSpan(ms); span != nil {
		defer span.End()
	}
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
		b.runShared()
	}
	if b.broken != nil {
		for _, m := range ms {
			b.replyWith(m, Answer{Err: fmt.Errorf("idempotency: DoTx %s: the transaction did not commit; nothing recorded: %w", m.d.Key(), b.broken)})
		}
		b.rollback()
	}
	return !conn.IsClosed() && conn.PgConn().TxStatus() == 'I'
}

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

// claimAll begins the transaction, holds every member's key and reads its row, in one
// round trip. A member that is not claimed is answered at once (a completed key's result
// is committed data; a key another transaction holds is busy). When the server refuses
// (or the connection fails), nothing is claimed and every member gets the error. It
// reports whether any member was claimed.
func (b *batch) claimAll(ms []*member) bool {
	e := b.e
	var ps []store.ClaimParams
	var live []*member
	for _, m := range ms {
		if err := m.ctx.Err(); err != nil {
			b.replyWith(m, Answer{Err: fmt.Errorf("idempotency: claim %s: %w", m.d.Key(), err)})
			continue
		}
		p, err := m.d.Claim(m.round)
		if err != nil {
			b.replyWith(m, Answer{Err: err})
			continue
		}
		ps, live = append(ps, p), append(live, m)
	}
	if len(live) == 0 {
		return false
	}
	ctx, cancel := b.ctx()
	defer cancel()
	t, err := e.cfg.Writes.BeginClaims(ctx, b.conn, b.idle, ps, e.cfg.MaxAge)
	if err != nil {
		if !store.Answered(err) {
			b.broken = own(err)
			return false
		}
		for _, m := range live {
			b.replyWith(m, Answer{Err: m.d.ClaimRefused(err)})
		}
		b.rollback()
		return false
	}
	b.xid, b.serverStart = t.XID, t.ServerStart
	for i, m := range live {
		claimed, again, err := m.d.Decide(&t.Rows[i], m.round)
		switch {
		case again:
			b.again(m, nil)
		case claimed:
			b.claimed = append(b.claimed, m)
		default:
			b.replyWith(m, Answer{Err: err})
		}
	}
	return len(b.claimed) > 0
}

// params are m's row in the finish.
func (b *batch) params(m *member) store.FinishParams {
	p := m.d.Identity()
	p.Action, p.Result, p.Error = m.finish.action, m.finish.result, m.finish.errMsg
	return p
}

func (b *batch) takePre() []string {
	p := b.pre
	b.pre = nil
	return p
}

// commit writes every completed or failed member's row in one statement and commits, in
// one round trip; then it answers those members. When the server refuses the finish (a
// row is not what the read found: a conflict, counted; or a result jsonb does not take),
// nothing committed, and the members not answered yet run again, alone, so that each
// outcome is the member's alone. With no row to write, the transaction rolls back.
func (b *batch) commit() {
	var ps []store.FinishParams
	for _, m := range b.claimed {
		if !m.answered && !m.later && m.finish.action != "" {
			ps = append(ps, b.params(m))
		}
	}
	if len(ps) == 0 {
		b.rollback()
		b.answerCommitted(nil)
		return
	}
	b.overlap()
	ctx, cancel := b.ctx()
	defer cancel()
	err := b.e.cfg.Writes.FinishAndCommit(ctx, b.conn, b.takePre(), b.e.lockTimeoutSQL, ps)
	if err != nil && store.Answered(err) {
		if store.Conflict(err) {
			b.e.observe(EventConflict, b.claimed[0])
		}
		b.rollback()
		b.rerunAlone()
		return
	}
	b.answerCommitted(err)
}

// overlap starts another executor, within the bound, when deliveries wait while this
// batch commits: the next transaction's first round trip overlaps this one's COMMIT
// instead of following it, which is what a handful of concurrent deliveries (c=10) wait
// on most.
func (b *batch) overlap() {
	if b.shared && b.e.q.Spare() {
		go b.e.runBatches()
	}
}

// answerCommitted answers the claimed members after the COMMIT, whose error is err. An
// error on a connection still open means nothing committed: the batch is broken. A
// COMMIT whose answer was lost is resolved by each member with the transaction id drawn
// with the claims.
func (b *batch) answerCommitted(err error) {
	if err != nil && (store.Answered(err) || !b.conn.IsClosed() || b.xid == "") {
		b.broken = own(err)
		return
	}
	for _, m := range b.claimed {
		m.d.Committed(b.xid, b.serverStart)
		switch {
		case m.answered:
		case m.later:
			// It did not run: it runs alone now, whatever the commit's fate.
			b.again(m, nil)
		case err != nil: // the answer was lost: each member resolves it by transaction id
			b.replyWith(m, Answer{Err: m.finish.err, Lost: err, Recorded: m.finish.err != nil})
		case m.finish.action == store.ActionFail:
			b.e.observe(EventFailed, m)
			b.replyWith(m, Answer{Err: m.finish.err, Recorded: true})
		default:
			b.e.observe(EventCompleted, m)
			b.replyWith(m, Answer{})
		}
	}
}

// batchSpan starts, when two or more of ms are traced, the span of the transaction they
// share, "idemq.shared_tx" (see sharedspan).
func (e *Exec) batchSpan(ms []*member) trace.Span {
	if e.cfg.Tracer == nil || len(ms) < 2 {
		return nil
	}
	var traced sharedspan.Members
	for _, m := range ms {
		traced.Add(trace.SpanFromContext(m.ctx))
	}
	return sharedspan.Start(e.cfg.Tracer, "idemq.shared_tx", len(ms), traced)
}
