package sharedtx

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency/internal/store"
)

// A batch: one shared transaction, from the claims of its members to its COMMIT.

// again has m run once more: in a transaction of its own, or, when it has a scope, in
// its line's next unit. After a conflict (its finish found the row changed since its
// read), that is so only up to requeueRounds: then the key is busy (store.Race).
func (b *batch) again(m *member, conflict bool) {
	switch {
	case m.answered:
	case conflict && m.round+1 >= requeueRounds:
		m.out.Verdict = store.Race
		b.reply(m, nil)
	case m.scope == "":
		m.out.alone = true
		b.reply(m, nil)
	default:
		m.answered, m.requeue = true, true
		m.round++
	}
}

// runBatches is an executor: it runs the queued deliveries in shared transactions on one
// connection, up to Config.MaxBatch (one per key, in key order) in each, until nothing is
// queued. Up to 2 × Config.Committers executors run at once.
func (e *Exec) runBatches() {
	var conn *pgxpool.Conn
	defer func() {
		if conn != nil {
			conn.Release()
		}
	}()
	for {
		// Take the connection first, so that members stay free to leave meanwhile.
		var acqErr error
		if conn == nil && e.q.Ready() {
			conn, acqErr = e.acquire()
		}
		n := e.turns.fit(e.Budget, e.cfg.MaxBatch)
		batches := e.q.Take(n)
		if batches == nil {
			return
		}
		ms := e.withLines(batches[0], n)
		if conn == nil && acqErr == nil {
			conn, acqErr = e.acquire()
		}
		if acqErr != nil {
			for _, m := range ms {
				m.answer <- Outcome{Err: own(fmt.Errorf("idempotency: claim %s: %w", m.d.Key, acqErr))}
			}
			e.q.Done(batches)
			e.afterLines(ms)
			continue
		}
		e.observeBatch(len(ms))
		span := e.batchSpan(ms)
		fit := e.runBatch(conn.Conn(), ms)
		if span != nil {
			span.End()
		}
		if !fit {
			conn.Release() // the pool closes a connection left in a transaction
			conn = nil
		}
		e.q.Done(batches)
		e.afterLines(ms)
	}
}

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
	// A delivery alone on its caller's goroutine waits for its key's lock, up to
	// ClaimLockTimeout, as a duplicate of a key another transaction runs should: it then
	// sees that transaction's row. A shared transaction waits for no key: a busy one must
	// not hold up the others.
	wait := len(live) == 1 && live[0].local
	t, err := b.e.cfg.Writes.BeginClaims(ctx, b.conn, b.idle, b.e.lockTimeoutSQL, wait, ps, b.e.cfg.MaxAge)
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
		if b.read(m, t.Rows[i]) {
			b.claimed = append(b.claimed, m)
		} else {
			b.reply(m, nil) // the row answers (a race, which no read of this kind finds, is busy)
		}
	}
	return len(b.claimed) > 0
}

// read sets m's outcome from its key's row as the transaction read it, and reports
// whether m took the key (EventClaimed, or EventTakeover).
func (b *batch) read(m *member, row store.ClaimRow) bool {
	m.out.Row, m.out.Verdict = row, row.Verdict(m.d.Fingerprint, b.e.cfg.MaxAge)
	switch {
	case m.out.Verdict != store.Claimed:
		return false
	case row.Attempts.Int32 > 1:
		b.e.observe(EventTakeover, m)
	default:
		b.e.observe(EventClaimed, m)
	}
	return true
}

// runSolo runs the one member a transaction claimed: no savepoint (its failure rolls the
// whole transaction back), and its row is written, with the COMMIT, in one round trip. A
// finish refused for a conflict (the row is not what the read found) has it run again. A
// permanent failure (the handler's, or a result jsonb refuses) is recorded after the
// rollback (record).
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
		if !r.panicked && b.e.cfg.Permanent(r.err) {
			b.record(m, failed(r.err.Error(), r.err))
			return
		}
		b.reply(m, r.err) // a panic is raised again
		return
	}
	b.complete(m, r.out)
	ctx, cancel := b.ctx()
	err := b.finishAndCommit(ctx, nil, []store.FinishParams{b.params(m)})
	cancel()
	var pgErr *pgconn.PgError
	switch {
	case store.Conflict(err):
		b.e.observe(EventConflict, m)
		b.rollback()
		b.again(m, true)
	case errors.As(err, &pgErr):
		b.rollback()
		m.out.Refused = pgErr
		if pgErr.Code[:2] == store.DataExceptionClass {
			b.record(m, failed(refusedResult+pgErr.Message, nil)) // answered as refused
			return
		}
		b.reply(m, nil)
	default:
		b.answerCommitted(err)
	}
}

// record writes m's row failed (f) after m's handler failed for good in the transaction
// that just rolled back, taking its effects with it: in a new transaction on the same
// connection, which holds and reads m's key again (a fresh fence) and, if m may still
// take it, writes the row with the COMMIT (Outcome.Recorded). A read that finds the key
// decided or held meanwhile (or is refused, as busy) answers m instead: that claim
// decides. A finish refused (a conflict, counted) or a connection that fails leaves the
// failure unrecorded (Outcome.Unrecorded), and m answered as it failed. The record is
// the ledger's own write, as a Fail is: the caller's ctx and deadline do not cut it.
func (b *batch) record(m *member, f finish) {
	failure := m.out
	unrecorded := func(err error) {
		b.rollback()
		m.out, m.out.Unrecorded = failure, err
		b.reply(m, f.err)
	}
	ctx, cancel := b.ctx()
	t, err := b.e.cfg.Writes.BeginClaims(ctx, b.conn, b.e.idleTimeout(time.Time{}), b.e.lockTimeoutSQL, m.local,
		[]store.ClaimParams{{Key: m.d.Key, TaskType: m.d.TaskType, Owner: failure.Owner, Fingerprint: m.d.Fingerprint, TraceID: m.d.TraceID}}, b.e.cfg.MaxAge)
	cancel()
	m.out = Outcome{Owner: failure.Owner, Refused: failure.Refused}
	switch {
	case err != nil && !store.Answered(err):
		unrecorded(err)
		return
	case err != nil:
		b.rollback()
		m.out.Refused = err
		b.reply(m, nil)
		return
	case !b.read(m, t.Rows[0]):
		b.rollback()
		m.out.Refused = nil
		b.reply(m, nil)
		return
	}
	b.xid, b.serverStart, m.finish = t.XID, t.ServerStart, f
	ctx, cancel = b.ctx()
	_, err = b.e.cfg.Writes.FinishAndCommit(ctx, b.conn, nil, b.e.lockTimeoutSQL, []store.FinishParams{b.params(m)}, nil)
	cancel()
	if err != nil && (store.Answered(err) || !b.conn.IsClosed()) {
		if store.Conflict(err) {
			b.e.observe(EventConflict, m)
		}
		unrecorded(err)
		return
	}
	b.answerCommitted(err)
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
	err := b.finishAndCommit(ctx, b.takePre(), ps)
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

// finishAndCommit writes the rows of ps and commits, with the keys' history events the
// ledger has waiting (Config.Events) in the same round trip, after the COMMIT.
func (b *batch) finishAndCommit(ctx context.Context, pre []string, ps []store.FinishParams) error {
	var events []store.EventParams
	if ev := b.e.cfg.Events; ev != nil {
		events = ev.TakeForCommit()
	}
	evErr, err := b.e.cfg.Writes.FinishAndCommit(ctx, b.conn, pre, b.e.lockTimeoutSQL, ps, events)
	if events != nil {
		b.e.cfg.Events.Done(events, err, evErr)
	}
	return err
}

// params are m's row in the finish.
func (b *batch) params(m *member) store.FinishParams { return finishParams(&m.d, &m.out, m.finish) }

// finishParams are the row the finish f writes for d, whose outcome so far is o.
func finishParams(d *Delivery, o *Outcome, f finish) store.FinishParams {
	r := &o.Row
	p := store.FinishParams{Key: d.Key, Fence: r.Fence.Int64, Owner: o.Owner, Action: f.action, Result: o.Stored, Error: o.LastErr,
		IntentSum: d.IntentSum, TaskType: d.TaskType, Fingerprint: d.Fingerprint, Attempt: int(r.Attempts.Int32), Generation: int(r.Generation.Int32), TraceID: d.TraceID,
		Found: r.Status.Valid}
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
			b.again(m, false)
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
		b.again(m, false)
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
