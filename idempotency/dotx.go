package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/internal/pgcode"
)

// storeResultTxSQL stores a DoTx result on the row the claim wrote completed. The division
// fails (SQLSTATE 22012) when the fenced update matched no row, which aborts the
// transaction, so the COMMIT pipelined after it cannot commit the effect without its
// completion. Only result and last_error change, which are not indexed: a HOT update.
func storeResultTxSQL(f fenceChecks) string {
	return `
WITH u AS (
	UPDATE processed_jobs SET result = $4, last_error = coalesce($5, last_error)
	WHERE idempotency_key = $1 AND ` + f.args + ` AND status = 'completed'
	RETURNING 1)
SELECT 1 / count(*) FROM u`
}

// idleTimeout is the idle_in_transaction_session_timeout of a claim's transaction (it
// matters for DoTx): Config.SessionTimeout, cut to the time left before the deadline.
func (l *Ledger) idleTimeout(deadline time.Time) string {
	idle := l.cfg.SessionTimeout
	if !deadline.IsZero() {
		idle = max(min(idle, time.Until(deadline)), time.Millisecond)
	}
	return strconv.FormatInt(max(1, idle.Milliseconds()), 10) + "ms"
}

// DoTx runs fn at most once per completed key, in transactional mode: for effects in this
// database. The claim, fn's writes through tx and the completion commit in one
// transaction, so a crash or an error anywhere leaves no trace and a database effect
// happens exactly once. The transaction runs at READ COMMITTED, with synchronous_commit
// on and idle_in_transaction_session_timeout at Config.SessionTimeout (cut to
// req.Deadline). The row lock is the lease: no heartbeat.
//
// Concurrent calls share transactions (unless Config.DisableGroupCommit): up to
// Config.Committers transactions run at once, each carrying the deliveries queued when it
// began (at most Config.MaxBatch, one per key, in key order), so at low load a
// transaction carries one delivery and waits for nothing. One multi-row statement claims
// every delivery's key; then each claimed delivery's fn runs, one after another on the
// shared connection, in a savepoint of its own (made at fn's first statement), and its
// result is stored, fenced, before the savepoint is released; one more statement ends
// every claimed row and the COMMIT follows in the same round trip. A delivery whose fn
// fails rolls back to its savepoint (its claim is undone by that last statement) and is
// answered at once; a key that is not claimed is answered at once too (a completed key's
// result is committed data); a delivery that completes is answered after the COMMIT,
// never before its write is durable. If that COMMIT fails, every delivery it carried gets
// an error and nothing of them was recorded. When the shared claim is refused (a lock
// wait cut short), each delivery runs in a transaction of its own instead. The idle
// timeout of a shared transaction is the longest its deliveries allow. A call whose ctx
// ends while it waits for a transaction returns ctx's error without running. A slow fn
// delays the deliveries after it in its transaction, and a ctx that ends while one of
// fn's queries runs closes the shared connection, failing the others (they may be
// retried).
//
// fn must do all its work through tx and no external I/O: the transaction may still roll
// back after it. tx's Commit and Rollback return an error (DoTx ends the transaction);
// Begin makes a savepoint, as pgx does. A concurrent duplicate waits up to
// Config.ClaimLockTimeout for the row and then gets a *BusyError, or sees the committed
// result (Result.Cached). The other claim outcomes come back as Claim's errors.
//
// When fn returns an error, its effect and its claim roll back and DoTx returns fn's
// error. If IsPermanent(err), the key is recorded as failed (in the shared transaction's
// last statement; alone, by a new claim and Fail, as in leased mode), so no delivery runs
// it again. When fn panics, the
// transaction rolls back and DoTx panics again with the same value. A result that cannot
// be stored completes the key with an error marker, as in Complete. If the connection
// drops during the commit, the outcome is learned from the transaction id
// (ErrCommitUnknown when it cannot be). Safe for concurrent use.
func (l *Ledger) DoTx(ctx context.Context, req Request, fn func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error)) (Result, error) {
	if err := req.validate(); err != nil {
		return Result{}, err
	}
	if !l.cfg.DisableGroupCommit {
		return l.doTxBatched(ctx, req, fn)
	}
	return l.doTxAlone(ctx, req, fn)
}

// doTxAlone is DoTx in a transaction of its own.
func (l *Ledger) doTxAlone(ctx context.Context, req Request, fn func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error)) (Result, error) {
	for round := 0; ; round++ {
		res, again, err := l.doTxOnce(ctx, req, fn, round)
		if !again {
			if IsPermanent(err) {
				l.recordPermanent(ctx, req, err)
			}
			return res, err
		}
	}
}

func (l *Ledger) doTxOnce(ctx context.Context, req Request, fn func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error), round int) (res Result, again bool, err error) {
	c, args, err := l.newClaim(req, true)
	if err != nil {
		return Result{}, false, err
	}
	conn, err := l.pool.Acquire(ctx)
	if err != nil {
		return Result{}, false, fmt.Errorf("idempotency: claim %s: %w", req.Key, err)
	}
	defer conn.Release()
	// BEGIN and the claim go in one round trip; the handler gets a pgx.Tx on the
	// transaction without another (handlerTx).
	pc := conn.Conn()
	tx := &handlerTx{conn: pc}
	done := false
	rollback := func() {
		if done {
			return
		}
		done = true
		if pc.PgConn().TxStatus() == 'I' {
			return
		}
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
		defer cancel()
		if _, err := pc.Exec(rctx, "ROLLBACK"); err != nil {
			pc.PgConn().Close(rctx) // closing the connection rolls back too
		}
	}
	defer rollback()

	var r claimRow
	b := &pgx.Batch{}
	b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
	b.Queue(claimSQL, args...)
	br := pc.SendBatch(ctx, b)
	_, err = br.Exec()
	if err == nil {
		err = r.scan(br.QueryRow())
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return Result{}, false, l.claimError(req, err)
	}
	if !r.claimed && r.attempted {
		if err := r.scan(tx.QueryRow(ctx, readRowSQL, req.Key)); errors.Is(err, pgx.ErrNoRows) {
			return Result{}, round+1 < maxClaimRounds, &BusyError{Key: req.Key}
		} else if err != nil {
			return Result{}, false, l.claimError(req, err)
		}
	}
	cr, stuck, again, err := l.decide(req, c, &r, round)
	if cr.Claim == nil {
		rollback()
		if stuck != 0 {
			conn.Release() // before taking another connection (Release is idempotent)
			l.markStuckOne(ctx, req, stuck)
		}
		if cr.Completed != nil {
			return *cr.Completed, false, nil
		}
		return Result{}, again, err
	}

	out, ferr, panicked, pval := runTxFn(withClaim(ctx, c.Key, c.Fence), tx, fn)
	if panicked {
		rollback()
		panic(pval)
	}
	if st := pc.PgConn().TxStatus(); ferr == nil && st != 'T' {
		ferr = fmt.Errorf("idempotency: DoTx %s: the handler ended or broke the transaction (status %q); nothing recorded", c.Key, st)
	}
	if ferr != nil {
		return Result{}, false, ferr
	}

	stored, lastErr := l.checkResult(c, out)
	err = l.commitTx(ctx, pc, c, stored, lastErr)
	done = true
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code[:2] == pgcode.DataExceptionClass && pgErr.Code != pgcode.DivisionByZero {
		// The database refused the result after all (a data exception), which aborted the
		// transaction and fn's effect with it: nothing happened; record that for good.
		return Result{}, false, Permanent(fmt.Errorf("idempotency: result refused by the database: %s", pgErr.Message))
	}
	if err != nil {
		return Result{}, false, err
	}
	l.observe(EventCompleted, c.TaskType)
	return Result{Key: c.Key, Result: storedForm(out, l.cfg.MaxResultBytes), Fence: c.Fence, Attempts: c.Attempt, Generation: c.Generation}, false, nil
}

// commitTx stores the result, if there is one, and commits, in one round trip. A lost
// connection is resolved with the transaction id taken at the claim. Whatever happens,
// the transaction is over (or its connection is closed) when it returns.
func (l *Ledger) commitTx(ctx context.Context, conn *pgx.Conn, c *Claim, stored, lastErr any) error {
	b := &pgx.Batch{}
	if stored != nil || lastErr != nil {
		b.Queue(l.sql.storeResultTx, c.Key, c.Fence, c.owner, stored, lastErr)
	}
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	var err error
	var tag pgconn.CommandTag
	for range b.Len() {
		if tag, err = br.Exec(); err != nil {
			break
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil && tag.String() != "COMMIT" {
		err = fmt.Errorf("idempotency: complete %s: commit answered %q", c.Key, tag.String())
	}
	if conn.PgConn().TxStatus() != 'I' && !conn.IsClosed() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
		if _, err := conn.Exec(rctx, "ROLLBACK"); err != nil {
			conn.PgConn().Close(rctx)
		}
		cancel()
	}
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		if pgErr.Code == pgcode.DivisionByZero {
			l.leaseLost(c, "completion")
			return fmt.Errorf("%w: key %q fence %d", ErrLeaseLost, c.Key, c.Fence)
		}
		return fmt.Errorf("idempotency: complete %s: %w", c.Key, err)
	}
	if !conn.IsClosed() {
		return err // answered, not lost (a commit answered ROLLBACK)
	}
	if ctx.Err() != nil {
		// Cancelled before an answer: resolve on a context of our own.
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
		defer cancel()
	}
	return l.commitLost(ctx, c, err)
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

func runTxFn(ctx context.Context, tx pgx.Tx, fn func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error)) (out json.RawMessage, err error, panicked bool, pval any) {
	defer func() {
		if r := recover(); r != nil {
			panicked, pval = true, r
		}
	}()
	out, err = fn(ctx, tx)
	return out, err, false, nil
}
