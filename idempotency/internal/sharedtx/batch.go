package sharedtx

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency/internal/pgcode"
	"github.com/idemq/idemq/idempotency/internal/pgtext"
	"github.com/idemq/idemq/idempotency/internal/sharedspan"
	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/idempotency/internal/txshim"
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

	pre     []string      // statements sent ahead of the next round trip (a RELEASE)
	own     time.Duration // the members' handlers' time outside the database so far
	claimed []*member     // members whose rows the finish ends, in order
	broken  error         // the transaction cannot commit
	// optimistic: the members run without savepoints, their results stored by the finish;
	// undone: one of them failed, so the transaction rolls back and every member runs
	// alone (its outcome then is its outcome alone).
	optimistic, undone bool
}

// runBatch runs ms, sorted by key, in one transaction on conn, and answers each. It
// reports whether conn is fit for another batch.
func (e *Exec) runBatch(conn *pgx.Conn, ms []*member) bool {
	// The transaction lives across its members: its idle timeout is the longest any
	// member allows, so no member's short deadline cuts the others off.
	var latest time.Time
	for _, m := range ms {
		if m.d.Deadline.IsZero() {
			latest = time.Time{}
			break
		}
		if m.d.Deadline.After(latest) {
			latest = m.d.Deadline
		}
	}
	b := &batch{e: e, conn: conn, idle: e.idleTimeout(latest)}
	if span := e.batchSpan(ms); span != nil {
		defer span.End()
	}
	switch {
	case !b.claimAll(ms):
		// Nothing claimed (completed keys, busy ones): the transaction wrote nothing; end
		// it so that the connection goes back to the pool (or on to the next batch)
		// instead of being closed for a transaction left open.
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
			b.reply(m, fmt.Errorf("idempotency: DoTx %s: the transaction did not commit; nothing recorded: %w", m.d.Key, b.broken))
		}
		b.rollback()
	}
	return !conn.IsClosed() && conn.PgConn().TxStatus() == 'I'
}

// claimAll begins the transaction, holds every member's key and reads its row, in one
// round trip. A member that is not claimed is answered at once (a completed key's result
// is committed data; a key another transaction holds is busy). When the server refuses
// (or the connection fails), nothing is claimed and every member gets the error. It
// reports whether any member was claimed.
func (b *batch) claimAll(ms []*member) bool {
	var ps []store.ClaimParams
	var live []*member
	for _, m := range ms {
		m.out = Outcome{}
		if err := m.ctx.Err(); err != nil {
			b.reply(m, fmt.Errorf("idempotency: claim %s: %w", m.d.Key, err))
			continue
		}
		if dl := m.d.Deadline; !dl.IsZero() && !time.Now().Before(dl) {
			b.reply(m, fmt.Errorf("idempotency: claim %s: the delivery deadline has passed: %w", m.d.Key, context.DeadlineExceeded))
			continue
		}
		owner, err := store.NewOwner()
		if err != nil {
			b.reply(m, fmt.Errorf("idempotency: owner id: %w", err))
			continue
		}
		m.out.Owner = owner
		ps = append(ps, store.ClaimParams{Key: m.d.Key, TaskType: m.d.TaskType, Owner: owner, Fingerprint: m.d.Fingerprint, TraceID: m.d.TraceID})
		live = append(live, m)
	}
	if len(live) == 0 {
		return false
	}
	ctx, cancel := b.ctx()
	defer cancel()
	t, err := b.e.cfg.Writes.BeginClaims(ctx, b.conn, b.idle, ps, b.e.cfg.MaxAge)
	if err != nil {
		if !store.Answered(err) {
			b.broken = own(err)
			return false
		}
		for _, m := range live {
			m.out.Refused = err
			b.reply(m, nil)
		}
		b.rollback()
		return false
	}
	b.xid, b.serverStart = t.XID, t.ServerStart
	for i, m := range live {
		m.out.Row, m.out.Verdict = t.Rows[i], t.Rows[i].Verdict(m.d.Fingerprint, b.e.cfg.MaxAge)
		switch {
		case m.out.Verdict != store.Claimed:
			b.reply(m, nil) // the row answers (a race, which no read of this kind finds, is busy)
		case m.out.Row.Attempts.Int32 > 1:
			b.e.observe(EventTakeover, m)
			b.claimed = append(b.claimed, m)
		default:
			b.e.observe(EventClaimed, m)
			b.claimed = append(b.claimed, m)
		}
	}
	return len(b.claimed) > 0
}

// runSolo runs the one member a transaction claimed: no savepoint (its failure rolls the
// whole transaction back), and its row is written, with the COMMIT, in one round trip. A
// finish refused for a conflict (the row is not what the read found) has it run again.
func (b *batch) runSolo(m *member) {
	if err := m.ctx.Err(); err != nil {
		b.rollback()
		b.reply(m, fmt.Errorf("idempotency: DoTx %s: %w", m.d.Key, err))
		return
	}
	r, ok := b.turn(m, nil)
	switch {
	case !ok:
		return
	case r.err != nil || r.panicked:
		b.rollback()
		b.reply(m, r.err) // a permanent error is recorded by its caller; a panic is raised again
		return
	}
	b.complete(m, r.out)
	ctx, cancel := b.ctx()
	err := b.e.cfg.Writes.FinishAndCommit(ctx, b.conn, nil, b.e.lockTimeoutSQL, []store.FinishParams{b.params(m)})
	cancel()
	var pgErr *pgconn.PgError
	switch {
	case store.Conflict(err):
		b.e.observe(EventConflict, m)
		b.rollback()
		b.again(m, err)
	case errors.As(err, &pgErr):
		b.rollback()
		m.out.Rejected = pgErr
		b.reply(m, nil)
	default:
		b.answerCommitted(err)
	}
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
		return store.Exec(ctx, b.conn, append(b.takePre(), store.Savepoint)...)
	})
	if !ok {
		return
	}
	if r.err == nil && !r.panicked {
		b.complete(m, r.out)
		var err error
		if m.out.Stored.Valid {
			// The server parses the result while the savepoint still holds the effect: a
			// value jsonb refuses rolls back this member alone, not the whole transaction.
			var pre []string
			if !saved {
				saved = true
				pre = append(b.takePre(), store.Savepoint)
			}
			ctx, cancel := b.ctx()
			err = store.CheckResult(ctx, b.conn, pre, m.out.Stored.String)
			cancel()
		}
		var pgErr *pgconn.PgError
		switch {
		case err == nil:
			if saved {
				b.pre = append(b.pre, store.Release)
			}
			return
		case !errors.As(err, &pgErr):
			b.broken = own(err)
			b.reply(m, b.broken)
			return
		}
		m.finish, m.out.Rejected = finish{}, pgErr
	}
	// fn failed: its effect goes with its savepoint.
	if saved {
		ctx, cancel := b.ctx()
		_, err := b.conn.Exec(ctx, store.Undo)
		cancel()
		if err != nil {
			b.broken = own(err)
			b.reply(m, errors.Join(r.err, b.broken))
			return
		}
	}
	switch rej := m.out.Rejected; {
	case r.panicked:
		b.reply(m, nil) // the member panics again
	case rej != nil && rej.Code[:2] == pgcode.DataExceptionClass:
		// A result jsonb refuses is recorded for good, with the commit.
		msg := "idempotency: result refused by the database: " + rej.Message
		m.finish = finish{action: store.ActionFail, errMsg: pgtype.Text{String: pgtext.Clean(msg), Valid: true}}
	case rej != nil:
		b.reply(m, nil)
	case b.e.cfg.Permanent(r.err):
		// Answered with the commit, which records the failure.
		m.finish = finish{action: store.ActionFail, errMsg: pgtype.Text{String: pgtext.Clean(r.err.Error()), Valid: true}, err: r.err}
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
	tx := txshim.New(b.conn, first)
	if m.local {
		r = m.runFn(tx)
	} else {
		m.run <- tx
		r = <-m.ran
	}
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

// complete has the finish write m's row completed with out, checked (pgtext.Result): the
// result itself, or an error marker in its place.
func (b *batch) complete(m *member, out []byte) {
	m.out.Out = out
	m.out.Stored, m.out.LastErr = pgtext.Result(out, b.e.cfg.MaxResultBytes)
	if m.out.LastErr.Valid {
		b.e.observe(EventBadResult, m)
	}
	m.finish = finish{action: store.ActionComplete}
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

// params are m's row in the finish.
func (b *batch) params(m *member) store.FinishParams {
	d, r, f := &m.d, &m.out.Row, m.finish
	p := store.FinishParams{Key: d.Key, Fence: r.Fence.Int64, Owner: m.out.Owner, Action: f.action, Result: m.out.Stored, Error: m.out.LastErr,
		IntentSum: d.IntentSum, TaskType: d.TaskType, Fingerprint: d.Fingerprint, Attempt: int(r.Attempts.Int32), Generation: int(r.Generation.Int32), TraceID: d.TraceID}
	if f.action == store.ActionFail {
		p.Result, p.Error = pgtype.Text{}, f.errMsg
	}
	return p
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
		m.out.XID, m.out.ServerStart = b.xid, b.serverStart
		switch {
		case m.answered:
		case m.later:
			// It did not run: it runs alone now, whatever the commit's fate.
			b.again(m, nil)
		case err != nil: // the answer was lost: each member resolves it by transaction id
			m.out.Lost, m.out.Recorded = err, m.finish.action == store.ActionFail
			b.reply(m, m.finish.err)
		case m.finish.action == store.ActionFail:
			b.e.observe(EventFailed, m)
			m.out.Recorded = true
			b.reply(m, m.finish.err)
		default:
			b.e.observe(EventCompleted, m)
			b.reply(m, nil)
		}
	}
}

// rerunAlone answers every member of an undone transaction that is not answered yet: it
// runs in a transaction of its own; and shared transactions give their members
// savepoints for a while.
func (b *batch) rerunAlone() {
	b.e.SavepointsUntil(time.Now().Add(SavepointsFor))
	for _, m := range b.claimed {
		if !m.answered {
			b.e.observe(EventSharedRerun, m)
		}
		b.again(m, nil)
	}
}

// reply answers m, once, with its outcome so far and err.
func (b *batch) reply(m *member, err error) {
	if m.answered {
		return
	}
	m.answered = true
	m.out.Err = err
	m.answer <- m.out
}

// ctx bounds one round trip of the executor: a claim's lock wait and a write.
func (b *batch) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), b.e.cfg.WriteTimeout+b.e.cfg.ClaimLockTimeout)
}

func (b *batch) takePre() []string {
	p := b.pre
	b.pre = nil
	return p
}

// rollback ends the transaction (or closes the connection).
func (b *batch) rollback() {
	ctx, cancel := b.ctx()
	defer cancel()
	store.Rollback(ctx, b.conn)
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
