package idempotency

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency/internal/txshim"
)

// idleTimeout is the idle_in_transaction_session_timeout of a claim's transaction (it
// matters for DoTx): Config.SessionTimeout, cut to the time left before the deadline.
func (l *Ledger) idleTimeout(deadline time.Time) string {
	idle := l.cfg.SessionTimeout
	if !deadline.IsZero() {
		idle = max(min(idle, time.Until(deadline)), time.Millisecond)
	}
	return strconv.FormatInt(max(1, idle.Milliseconds()), 10) + "ms"
}

// DoTx commits fn's work at most once per completed key, in transactional mode: for
// effects in this database. The claim, fn's writes through tx and the completion commit in one
// transaction, so a crash or an error anywhere leaves no trace and a database effect
// happens exactly once. The transaction runs at READ COMMITTED, with synchronous_commit
// on and idle_in_transaction_session_timeout at Config.SessionTimeout (cut to
// req.Deadline). The row lock is the lease: no heartbeat.
//
// Concurrent calls share transactions (unless Config.DisableGroupCommit): up to
// 2 × Config.Committers transactions run at once (more than Config.Committers only while
// deliveries queue), each carrying the deliveries queued when it began (at most as many
// as fit in 5 ms at the measured cost of one, at most Config.MaxBatch, one per key, in
// key order), so at low load a transaction carries one delivery and waits for nothing.
// One multi-row statement claims every delivery's key; then each claimed delivery's fn
// runs, one after another on the shared connection, and one more statement stores every
// result and ends every claimed row, with the COMMIT in the same round trip. A delivery is
// answered after that COMMIT, never before its write is durable. If any fn fails (an
// error, a panic, a transaction left aborted) or that last statement is refused (a result
// jsonb does not take), the whole transaction rolls back and every delivery in it runs
// again in a transaction of its own, so that each outcome is the delivery's outcome
// alone: fn may run more than once per delivery, its writes rolled back in between. For 5 s
// after such a rollback, shared transactions give each fn a savepoint of its own (made at
// its first statement; its result stored before the savepoint is released) and a failing
// fn rolls back to it alone. If a COMMIT fails, every delivery it carried gets an error
// and nothing of them was recorded. When the shared claim is refused (a lock wait cut
// short), each delivery runs in a transaction of its own instead. Deliveries whose fn
// spends over 1 ms on average outside the database (txshim: the time its queries take
// does not count) run in transactions of their own, side by side. The idle timeout of a
// shared transaction is the longest its deliveries allow. A call whose ctx ends while it
// waits for a transaction returns ctx's error without running. A slow fn delays the
// deliveries after it in its transaction, and a ctx that ends while one of fn's queries
// runs closes the shared connection, failing the others (they may be retried).
//
// fn must do all its work through tx and no external I/O: the transaction may still roll
// back after it. tx's Commit and Rollback return an error (DoTx ends the transaction);
// Begin makes a savepoint, as pgx does. A concurrent duplicate waits up to
// Config.ClaimLockTimeout for the row and then gets a *BusyError, or sees the committed
// result (Result.Cached). The other claim outcomes come back as Claim's errors.
//
// When fn returns an error, its effect and its claim roll back and DoTx returns fn's
// error. If IsPermanent(err), the key is recorded as failed (in the shared transaction's
// last statement; in a transaction of its own, by a new claim and Fail, as in leased
// mode), so no delivery runs it again. When fn panics, the
// transaction rolls back and DoTx panics again with the same value. A result that cannot
// be stored completes the key with an error marker, as in Complete. If the connection
// drops during the commit, the outcome is learned from the transaction id
// (ErrCommitUnknown when it cannot be). Safe for concurrent use.
func (l *Ledger) DoTx(ctx context.Context, req Request, fn func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error)) (Result, error) {
	if err := req.validate(); err != nil {
		return Result{}, err
	}
	if l.cfg.DisableGroupCommit || l.txTimes.slow(l.txSlow) {
		// Handlers this slow gain nothing from sharing a connection: alone, side by side.
		return l.doTxAlone(ctx, req, fn, 0, !l.cfg.DisableGroupCommit)
	}
	return l.doTxShared(ctx, req, fn)
}

// doTxShared is DoTx in a transaction shared with concurrent deliveries: the delivery
// queues, and the executor that takes it hands the claimed transaction to this goroutine
// for fn's turn (txMember).
func (l *Ledger) doTxShared(ctx context.Context, req Request, fn func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error)) (Result, error) {
	m := newTxMember(ctx, req, nil)
	m.timed = true
	if l.txq.PushDeep(0, m, l.memberTimes.fit(l.txBudget, l.cfg.MaxBatch)) {
		go l.runTxBatches()
	}
	done := ctx.Done()
	for {
		select {
		case <-done:
			if l.txq.Leave(0, m) {
				return Result{}, fmt.Errorf("idempotency: claim %s: %w", req.Key, ctx.Err())
			}
			done = nil // taken: the executor answers, at the latest when its turn comes
		case t := <-m.run:
			ran, pval := runTxFn(withClaim(ctx, t.c.Key, t.c.Fence), t.tx, fn)
			m.ran <- ran
			if ran.panicked {
				<-m.answer // rolled back
				panic(pval)
			}
		case a := <-m.answer:
			if a.alone {
				return l.doTxAlone(ctx, req, fn, 1, false)
			}
			return l.settle(ctx, m, a)
		}
	}
}

// doTxAlone is DoTx in a transaction of its own: a batch of one, run on the caller's
// goroutine. A claim that lost a race is tried again, from round on, up to
// maxClaimRounds. timed: fn's run time joins the moving average (txMember.timed).
func (l *Ledger) doTxAlone(ctx context.Context, req Request, fn func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error), round int, timed bool) (Result, error) {
	for ; ; round++ {
		m := newTxMember(ctx, req, fn)
		m.round, m.timed = round, timed
		conn, err := l.pool.Acquire(ctx)
		if err != nil {
			return Result{}, fmt.Errorf("idempotency: claim %s: %w", req.Key, err)
		}
		l.runTxBatch(conn.Conn(), []*txMember{m})
		conn.Release() // the pool closes a connection left in a transaction
		a := <-m.answer
		if m.panicked {
			panic(m.pval)
		}
		if !a.alone {
			return l.settle(ctx, m, a)
		}
	}
}

// settle finishes what a DoTx answer leaves to its caller: a stuck key to mark, a commit
// whose answer was lost to resolve, a permanent failure to record.
func (l *Ledger) settle(ctx context.Context, m *txMember, a txAnswer) (Result, error) {
	if a.stuck != 0 {
		l.markStuckOne(ctx, m.req, a.stuck)
	}
	if a.lost != nil {
		rctx := ctx
		if ctx.Err() != nil {
			var cancel context.CancelFunc
			rctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
			defer cancel()
		}
		if err := l.commitLost(rctx, m.claim, a.lost); err != nil {
			return Result{}, err
		}
		if a.err == nil {
			l.observe(EventCompleted, m.req.TaskType)
		}
	}
	if IsPermanent(a.err) && !a.recorded {
		l.recordPermanent(ctx, m.req, a.err)
	}
	return a.res, a.err
}

// recordPermanent records a permanent DoTx failure, whose transaction rolled back, with a
// claim of its own and a fenced Fail. If another delivery holds or finished the key
// meanwhile, that one decides.
func (l *Ledger) recordPermanent(ctx context.Context, req Request, cause error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
	defer cancel()
	cr, err := l.Claim(ctx, req)
	if err == nil && cr.Claim != nil {
		err = l.Fail(ctx, cr.Claim, cause)
	}
	if err != nil {
		l.log.Warn("idempotency: record a permanent failure", "task_type", req.TaskType, "key", req.Key, "err", err, "cause", cause)
	}
}

// runTxFn runs fn on tx, recovering a panic (its value is pval).
func runTxFn(ctx context.Context, tx *txshim.Tx, fn func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error)) (ran txRan, pval any) {
	began := time.Now()
	defer func() {
		ran.own = time.Since(began) - tx.InDB()
		if r := recover(); r != nil {
			ran.panicked, pval = true, r
		}
	}()
	ran.out, ran.err = fn(ctx, tx)
	return ran, nil
}
