package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/idempotency/internal/txshim"
	"github.com/idemq/idemq/internal/pgcode"
)

// claimAll begins the transaction and claims every member's key in one statement. A
// member that is not claimed is answered at once (a completed key's result is committed
// data). When the server refuses the statement (a lock wait cut short, say), nothing is
// claimed: a member alone gets the refusal, several each run alone instead. It reports
// whether any member was claimed.
func (b *txBatch) claimAll(ms []*txMember) bool {
	l := b.l
	var ps []store.ClaimParams
	var live []*txMember
	for _, m := range ms {
		if err := m.ctx.Err(); err != nil {
			b.replyWith(m, txAnswer{err: fmt.Errorf("idempotency: claim %s: %w", m.req.Key, err)})
			continue
		}
		c, p, err := l.newClaim(m.req)
		if err != nil {
			b.replyWith(m, txAnswer{err: err})
			continue
		}
		m.claim = c
		ps, live = append(ps, p), append(live, m)
	}
	if len(live) == 0 {
		return false
	}
	ctx, cancel := b.ctx()
	defer cancel()
	t, err := store.BeginClaims(ctx, b.conn, b.idle, l.lockTimeoutSQL, ps, l.cfg.MaxAge)
	if err != nil {
		if !store.Answered(err) {
			b.broken = err
			return false
		}
		// Refused (a lock timeout, a constraint): nothing was claimed.
		for _, m := range live {
			if len(live) == 1 {
				b.replyWith(m, txAnswer{err: l.claimError(m.req, err)})
			} else {
				b.replyWith(m, txAnswer{alone: true}) // its own transaction tells it what happened
			}
		}
		b.rollback()
		return false
	}
	b.xid, b.serverStart = t.XID, t.ServerStart
	for i, m := range live {
		r := &t.Rows[i]
		if !t.Answered[i] || !r.Claimed && r.Attempted {
			*r = store.ClaimRow{} // a lost race: decide looks again, alone, or reports busy
		}
		cr, stuck, again, err := l.decide(m.req, m.claim, r, m.round)
		switch {
		case again:
			b.replyWith(m, txAnswer{alone: true})
		case cr.Claim != nil:
			b.claimed = append(b.claimed, m)
		default:
			a := txAnswer{err: err, stuck: stuck}
			if cr.Completed != nil {
				a.res = *cr.Completed
			}
			b.replyWith(m, a)
		}
	}
	return len(b.claimed) > 0
}

// runFn has m's fn run on tx: on this goroutine for a local member, else on m's own.
// A timed member's time outside the database joins the moving average that decides
// whether deliveries share transactions: on a saturated machine every query takes
// longer, which is when sharing matters most, so the database's time is no reason to
// stop.
func (b *txBatch) runFn(m *txMember, tx *txshim.Tx) txRan {
	var ran txRan
	if m.fn != nil {
		ran, m.pval = runTxFn(withClaim(m.ctx, m.claim.Key, m.claim.Fence), tx, m.fn)
		m.panicked = ran.panicked
	} else {
		m.run <- txTurn{tx: tx, c: m.claim}
		ran = <-m.ran
	}
	if m.timed {
		b.l.txTimes.record(ran.own)
	}
	return ran
}

// afterHandler checks the transaction after m's handler ran. A handler that broke it
// (the connection closed or busy, the transaction neither open nor aborted) breaks the
// batch and m is answered: ok is false. A handler that succeeded but left the
// transaction aborted gets that as its error: nothing of it is recorded.
func (b *txBatch) afterHandler(m *txMember, ran txRan) (_ txRan, ok bool) {
	pc := b.conn.PgConn()
	st := pc.TxStatus()
	if b.conn.IsClosed() || pc.IsBusy() || st != 'T' && st != 'E' {
		b.broken = fmt.Errorf("idempotency: DoTx %s: the handler ended or broke the transaction (status %q)", m.req.Key, st)
		b.replyWith(m, txAnswer{err: errors.Join(ran.err, b.broken)})
		return ran, false
	}
	if ran.err == nil && !ran.panicked && st != 'T' {
		ran.err = fmt.Errorf("idempotency: DoTx %s: the handler ended or broke the transaction (status %q); nothing recorded", m.req.Key, st)
	}
	return ran, true
}

// runMember runs m's fn on the shared transaction. The member's savepoint is made when fn
// first uses the transaction; it is released when fn succeeds (after the database
// accepted its result as jsonb) and rolled back when fn fails.
func (b *txBatch) runMember(m *txMember) {
	c := m.claim
	m.finish = txFinish{action: store.ActionForget}
	if err := m.ctx.Err(); err != nil {
		b.replyWith(m, txAnswer{err: fmt.Errorf("idempotency: DoTx %s: %w", c.Key, err)})
		return
	}
	saved := false
	tx := txshim.New(b.conn, func(ctx context.Context) error {
		saved = true
		return store.Exec(ctx, b.conn, append(b.takePre(), store.Savepoint)...)
	})
	ran := b.runFn(m, tx)
	ran, ok := b.afterHandler(m, ran)
	if !ok {
		return
	}
	if ran.err == nil && !ran.panicked {
		stored, lastErr := b.l.checkResult(c, ran.out)
		var err error
		if stored.Valid || lastErr.Valid {
			// The result is stored, fenced, while the savepoint still holds the effect: a
			// row taken meanwhile, or a value jsonb refuses, rolls back this member alone.
			var pre []string
			if !saved {
				saved = true
				pre = append(b.takePre(), store.Savepoint)
			}
			ctx, cancel := b.ctx()
			err = b.l.writes.StoreResult(ctx, b.conn, pre, store.StoredResult{Finish: b.params(m), Result: stored, Error: lastErr})
			cancel()
		}
		var pgErr *pgconn.PgError
		switch {
		case err == nil:
			if saved {
				b.pre = append(b.pre, store.Release)
			}
			m.finish, m.res = txFinish{action: store.ActionComplete}, c.completed(ran.out, stored, lastErr)
			return
		case !errors.As(err, &pgErr):
			b.broken = err
			b.replyWith(m, txAnswer{err: err})
			return
		default:
			ran.err = b.l.resultRefused(c, pgErr)
		}
	}
	// fn failed: its effect goes with its savepoint; its claim is ended by the finish.
	if saved {
		ctx, cancel := b.ctx()
		_, err := b.conn.Exec(ctx, store.Undo)
		cancel()
		if err != nil {
			b.broken = err
			b.replyWith(m, txAnswer{err: errors.Join(ran.err, err)})
			return
		}
	}
	if ran.panicked {
		b.replyWith(m, txAnswer{}) // the member panics again
		return
	}
	if IsPermanent(ran.err) {
		m.finish = txFinish{action: store.ActionFail, errMsg: pgtype.Text{String: cleanText(ran.err.Error()), Valid: true}, err: ran.err}
		return // answered with the commit, which records the failure
	}
	b.replyWith(m, txAnswer{err: ran.err})
}

// runOptimistic runs m's fn on the shared transaction without a savepoint: its result is
// stored by the finish. A handler that fails (or panics, or leaves the transaction
// aborted) undoes the whole transaction; every member then runs alone, a panicking one
// panics again.
func (b *txBatch) runOptimistic(m *txMember) {
	c := m.claim
	m.finish = txFinish{action: store.ActionForget}
	if err := m.ctx.Err(); err != nil {
		b.replyWith(m, txAnswer{err: fmt.Errorf("idempotency: DoTx %s: %w", c.Key, err)})
		return
	}
	b.l.observe(EventSharedRun, m.req.TaskType)
	ran := b.runFn(m, txshim.New(b.conn, nil))
	ran, ok := b.afterHandler(m, ran)
	switch {
	case !ok:
	case ran.panicked:
		b.undone = true
		b.replyWith(m, txAnswer{}) // the member panics again
	case ran.err != nil:
		b.undone = true
	default:
		stored, lastErr := b.l.checkResult(c, ran.out)
		m.finish = txFinish{action: store.ActionStore, result: stored, errMsg: lastErr}
		m.res = c.completed(ran.out, stored, lastErr)
	}
}

// rerunAlone answers every member of an undone transaction that is not answered yet: it
// runs in a transaction of its own; and shared transactions give their members
// savepoints for a while.
func (b *txBatch) rerunAlone() {
	b.l.savepointsUntil.Store(time.Now().Add(txSavepointsFor).UnixNano())
	for _, m := range b.claimed {
		if !m.answered {
			b.l.observe(EventSharedRerun, m.req.TaskType)
		}
		b.replyWith(m, txAnswer{alone: true})
	}
}

// resultRefused is the error of a member whose result the database refused: its claim no
// longer holds the row (the fenced store's division by zero), or the value is one jsonb
// refuses (a data exception), which is recorded for good.
func (l *Ledger) resultRefused(c *Claim, pgErr *pgconn.PgError) error {
	switch {
	case pgErr.Code == pgcode.DivisionByZero:
		l.leaseLost(c, "completion")
		return fmt.Errorf("%w: key %q fence %d", ErrLeaseLost, c.Key, c.Fence)
	case pgErr.Code[:2] == pgcode.DataExceptionClass:
		return Permanent(fmt.Errorf("idempotency: result refused by the database: %s", pgErr.Message))
	}
	return fmt.Errorf("idempotency: complete %s: %w", c.Key, pgErr)
}

// runSolo runs the one member a transaction claimed: no savepoint (its failure rolls the
// whole transaction back, claim and all), and its result is stored, which completes it,
// with the COMMIT, in one round trip.
func (b *txBatch) runSolo(m *txMember) {
	c := m.claim
	if err := m.ctx.Err(); err != nil {
		b.rollback()
		b.replyWith(m, txAnswer{err: fmt.Errorf("idempotency: DoTx %s: %w", c.Key, err)})
		return
	}
	ran := b.runFn(m, txshim.New(b.conn, nil))
	ran, ok := b.afterHandler(m, ran)
	if !ok {
		return
	}
	if ran.err != nil || ran.panicked {
		b.rollback()
		b.replyWith(m, txAnswer{err: ran.err}) // a permanent error is recorded by its caller
		return
	}
	stored, lastErr := b.l.checkResult(c, ran.out)
	m.finish, m.res = txFinish{action: store.ActionComplete}, c.completed(ran.out, stored, lastErr)
	ctx, cancel := b.ctx()
	err := b.l.writes.StoreAndCommit(ctx, b.conn, store.StoredResult{Finish: b.params(m), Result: stored, Error: lastErr})
	cancel()
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		b.rollback()
		b.replyWith(m, txAnswer{err: b.l.resultRefused(c, pgErr)})
		return
	}
	b.answerCommitted(err)
}

// params are m's row in the finish.
func (b *txBatch) params(m *txMember) store.FinishParams {
	c := m.claim
	return store.FinishParams{Key: c.Key, Fence: c.Fence, Owner: c.owner, Action: m.finish.action, Result: m.finish.result, Error: m.finish.errMsg}
}

func (b *txBatch) takePre() []string {
	p := b.pre
	b.pre = nil
	return p
}

// commit ends every claimed row in one statement (completed, failed, or forgotten: the
// row a failed handler's claim inserted is deleted, a taken-over one ends its lease) and
// commits, in one round trip; then it answers the members whose rows it completed or
// failed.
func (b *txBatch) commit() {
	ps := make([]store.FinishParams, len(b.claimed))
	for i, m := range b.claimed {
		ps[i] = b.params(m)
	}
	ctx, cancel := b.ctx()
	defer cancel()
	err := b.l.writes.FinishAndCommit(ctx, b.conn, b.takePre(), ps)
	if err != nil && b.optimistic && store.Answered(err) {
		// The finish was refused (a result jsonb does not take): nothing committed, and
		// whose result it was, the members alone will tell.
		b.rollback()
		b.rerunAlone()
		return
	}
	b.answerCommitted(err)
}

// answerCommitted answers the claimed members after the COMMIT, whose error is err. An
// error the server answered (or any on a connection still open) means nothing committed:
// the batch is broken. A COMMIT whose answer was lost is resolved by each member with the
// transaction id drawn with the claims.
func (b *txBatch) answerCommitted(err error) {
	if err != nil && (store.Answered(err) || !b.conn.IsClosed() || b.xid == "") {
		b.broken = err
		return
	}
	for _, m := range b.claimed {
		m.claim.xid, m.claim.serverStart = b.xid, b.serverStart
		switch {
		case m.later:
			// Its claim is gone (forgotten by the commit, or never committed if the lost
			// answer was a failure): it runs alone now. It must be answered whatever the
			// commit's fate: it waits for nothing else.
			b.replyWith(m, txAnswer{alone: true})
		case m.finish.action == store.ActionForget:
		case err != nil: // the answer was lost: each member resolves it by transaction id
			b.replyWith(m, txAnswer{res: m.res, err: m.finish.err, lost: err, recorded: m.finish.err != nil})
		case m.finish.action == store.ActionFail:
			b.l.observe(EventFailed, m.req.TaskType)
			b.replyWith(m, txAnswer{err: m.finish.err, recorded: true})
		default:
			b.l.observe(EventCompleted, m.req.TaskType)
			b.replyWith(m, txAnswer{res: m.res})
		}
	}
}
