package sharedtx

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/idempotency/internal/txshim"
)

// runFn has m's fn run on tx: on this goroutine for a local member, else on m's own.
// A timed member's time outside the database joins the moving average that decides
// whether deliveries share transactions: on a saturated machine every query takes
// longer, which is when sharing matters most, so the database's time is no reason to
// stop.
func (b *batch) runFn(m *member, tx *txshim.Tx) ran {
	var r ran
	if m.fn != nil {
		r, m.pval = runFn(m.d.Context(m.ctx), tx, m.fn)
		m.panicked = r.panicked
	} else {
		m.run <- tx
		r = <-m.ran
	}
	if m.timed {
		b.e.handlers.record(r.own)
	}
	b.own += r.own
	return r
}

// afterHandler checks the transaction after m's handler ran. A handler that broke it
// (the connection closed or busy, the transaction neither open nor aborted) breaks the
// batch and m is answered: ok is false. A handler that succeeded but left the
// transaction aborted gets that as its error: nothing of it is recorded.
func (b *batch) afterHandler(m *member, r ran) (_ ran, ok bool) {
	pc := b.conn.PgConn()
	st := pc.TxStatus()
	if b.conn.IsClosed() || pc.IsBusy() || st != 'T' && st != 'E' {
		b.broken = fmt.Errorf("idempotency: DoTx %s: the handler ended or broke the transaction (status %q)", m.d.Key(), st)
		b.replyWith(m, Answer{Err: errors.Join(r.err, b.broken)})
		return r, false
	}
	if r.err == nil && !r.panicked && st != 'T' {
		r.err = fmt.Errorf("idempotency: DoTx %s: the handler ended or broke the transaction (status %q); nothing recorded", m.d.Key(), st)
	}
	return r, true
}

// runMember runs m's fn on the shared transaction. The member's savepoint is made when fn
// first uses the transaction; it is released when fn succeeds and the server takes its
// result (its row is written by the finish) and rolled back when fn fails (its row is not
// written, or written failed).
func (b *batch) runMember(m *member) {
	m.finish = finish{}
	if err := m.ctx.Err(); err != nil {
		b.replyWith(m, Answer{Err: fmt.Errorf("idempotency: DoTx %s: %w", m.d.Key(), err)})
		return
	}
	saved := false
	tx := txshim.New(b.conn, func(ctx context.Context) error {
		saved = true
		return store.Exec(ctx, b.conn, append(b.takePre(), store.Savepoint)...)
	})
	r, ok := b.afterHandler(m, b.runFn(m, tx))
	if !ok {
		return
	}
	if r.err == nil && !r.panicked {
		stored, lastErr := m.d.Check(r.out)
		var err error
		if stored.Valid {
			// The server parses the result while the savepoint still holds the effect: a
			// value jsonb refuses rolls back this member alone, not the whole transaction.
			var pre []string
			if !saved {
				saved = true
				pre = append(b.takePre(), store.Savepoint)
			}
			ctx, cancel := b.ctx()
			err = store.CheckResult(ctx, b.conn, pre, stored.String)
			cancel()
		}
		var pgErr *pgconn.PgError
		switch {
		case err == nil:
			if saved {
				b.pre = append(b.pre, store.Release)
			}
			m.finish = finish{action: store.ActionComplete, result: stored, errMsg: lastErr}
			return
		case !errors.As(err, &pgErr):
			b.broken = own(err)
			b.replyWith(m, Answer{Err: b.broken})
			return
		default:
			r.err = m.d.Refused(pgErr)
		}
	}
	// fn failed: its effect goes with its savepoint.
	if saved {
		ctx, cancel := b.ctx()
		_, err := b.conn.Exec(ctx, store.Undo)
		cancel()
		if err != nil {
			b.broken = own(err)
			b.replyWith(m, Answer{Err: errors.Join(r.err, b.broken)})
			return
		}
	}
	if r.panicked {
		b.replyWith(m, Answer{}) // the member panics again
		return
	}
	if b.e.cfg.Permanent(r.err) {
		m.finish = finish{action: store.ActionFail, errMsg: pgtype.Text{String: b.e.cfg.CleanText(r.err.Error()), Valid: true}, err: r.err}
		return // answered with the commit, which records the failure
	}
	b.replyWith(m, Answer{Err: r.err}) // no row: the next delivery runs it
}

// runOptimistic runs m's fn on the shared transaction without a savepoint: its result is
// stored by the finish. A handler that fails (or panics, or leaves the transaction
// aborted) undoes the whole transaction; every member then runs alone, a panicking one
// panics again.
func (b *batch) runOptimistic(m *member) {
	m.finish = finish{}
	if err := m.ctx.Err(); err != nil {
		b.replyWith(m, Answer{Err: fmt.Errorf("idempotency: DoTx %s: %w", m.d.Key(), err)})
		return
	}
	b.e.observe(EventSharedRun, m)
	r, ok := b.afterHandler(m, b.runFn(m, txshim.New(b.conn, nil)))
	switch {
	case !ok:
	case r.panicked:
		b.undone = true
		b.replyWith(m, Answer{}) // the member panics again
	case r.err != nil:
		b.undone = true
	default:
		stored, lastErr := m.d.Check(r.out)
		m.finish = finish{action: store.ActionComplete, result: stored, errMsg: lastErr}
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

// runSolo runs the one member a transaction claimed: no savepoint (its failure rolls the
// whole transaction back), and its row is written, with the COMMIT, in one round trip. A
// finish refused for a conflict (the row is not what the read found) has it run again.
func (b *batch) runSolo(m *member) {
	if err := m.ctx.Err(); err != nil {
		b.rollback()
		b.replyWith(m, Answer{Err: fmt.Errorf("idempotency: DoTx %s: %w", m.d.Key(), err)})
		return
	}
	r, ok := b.afterHandler(m, b.runFn(m, txshim.New(b.conn, nil)))
	if !ok {
		return
	}
	if r.err != nil || r.panicked {
		b.rollback()
		b.replyWith(m, Answer{Err: r.err}) // a permanent error is recorded by its caller
		return
	}
	stored, lastErr := m.d.Check(r.out)
	m.finish = finish{action: store.ActionComplete, result: stored, errMsg: lastErr}
	b.overlap()
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
		b.replyWith(m, Answer{Err: m.d.Refused(pgErr)})
	default:
		b.answerCommitted(err)
	}
}
