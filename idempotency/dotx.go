package idempotency

import (
	"context"
	"encoding/json"
	"errors"

	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency/internal/sharedtx"
	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/jackc/pgx/v5"
)

// DoTx commits fn's work at most once per completed key, in transactional mode: for
// effects in this database. fn's writes through tx and the key's ledger row commit in one
// transaction, so a crash or an error anywhere leaves no trace and a database effect
// happens exactly once. The transaction runs at READ COMMITTED, with synchronous_commit
// on and idle_in_transaction_session_timeout at Config.SessionTimeout (cut to
// req.Deadline).
//
// The row is written once, at the end. The transaction's first round trip takes a
// transaction-scoped advisory lock on a 64-bit hash of the key (held by another
// transaction: a *BusyError, and fn does not run; this lock, not a row, keeps two
// transactions off one key while fn runs), reads the key's row (completed: the stored
// result, Result.Cached; the other outcomes come back as Claim's errors; in progress
// under a lease that ended: taken over) and draws the claim's fence, which fn reads from
// its ctx (FromContext). After fn, one statement writes the row, completed or failed,
// re-checking on the newest row version what the read found, and fails unless it wrote
// it, so that the COMMIT sent after it cannot commit fn's effect without the row: then
// the transaction rolls back (EventTxConflict) and fn runs again, seeing what changed.
//
// Concurrent calls share transactions (unless Config.DisableGroupCommit): up to
// 2 × Config.Committers transactions run at once (more than Config.Committers only while
// deliveries queue), each carrying the deliveries queued when it began (at most as many
// as fit in 20 ms at the measured cost of one, at most Config.MaxBatch, one per key, in
// key order), so at low load a transaction carries one delivery and waits for nothing.
// Each claimed delivery's fn runs, one after another on the shared connection, and one
// statement writes every row, with the COMMIT in the same round trip. A delivery is
// answered after that COMMIT, never before its write is durable. If any fn fails (an
// error, a panic, a transaction left aborted) or that last statement is refused (a row
// changed since the read, a result jsonb does not take), the whole transaction rolls back
// and every delivery in it runs again in a transaction of its own, so that each outcome
// is the delivery's outcome alone: fn may run more than once per delivery, its writes
// rolled back in between. For 5 s after such a rollback, shared transactions give each fn
// a savepoint of its own (made at its first statement) and a failing fn rolls back to it
// alone. If a COMMIT fails, every delivery it carried gets an error and nothing of them
// was recorded. Deliveries whose fn spends over 1 ms on average outside the database
// (sharedtx: time its queries take does not count) run in transactions of their own,
// side by side. The idle timeout of a shared transaction is the longest its deliveries
// allow. A call whose ctx ends while it waits for a transaction returns ctx's error
// without running. A slow fn delays the deliveries after it in its transaction, and a ctx
// that ends while one of fn's queries runs closes the shared connection, failing the
// others (they may be retried).
//
// fn must do all its work through tx and no external I/O: the transaction may still roll
// back after it. tx's Commit and Rollback return an error (DoTx ends the transaction);
// Begin makes a savepoint, as pgx does. A row another session keeps locked past
// Config.ClaimLockTimeout when the row is written makes the key busy.
//
// When fn returns an error, its effect rolls back, no row is written and DoTx returns
// fn's error (asynq retries it, counting its attempts and keeping its error). If
// IsPermanent(err), the key is recorded as failed, so no delivery runs it again: in the
// shared transaction's last statement, or, for fn run in a transaction of its own, after
// the rollback, by a new transaction on the same connection that holds and reads the key
// again and writes its row failed; if that read finds the key finished or held by another
// delivery meanwhile, that delivery decides, and DoTx answers what the read found (a
// cached result, ErrBusy, …). When fn panics, the transaction rolls back and DoTx panics
// again with the same value. A result that cannot be stored completes the key with an
// error marker, as in Complete. If the connection drops during the commit, the outcome is
// learned from the transaction id, within Config.WriteTimeout (ErrCommitUnknown when it
// cannot be). An error of DoTx's own work on the database (a connection, the read, the
// row's write, the COMMIT, the commit's resolution) that says Postgres could not be
// reached or did not answer within Config.WriteTimeout wraps ErrUnavailable, unless ctx
// ended first; fn's errors never do, a query of fn's own that timed out included. Safe
// for concurrent use.
func (l *Ledger) DoTx(ctx context.Context, req Request, fn func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error)) (Result, error) {
	if err := req.validate(); err != nil {
		return Result{}, err
	}
	// One span under the delivery's for the claim, fn's work and the completion, which
	// commit together (endTxSpan says what the transaction decided).
	ctx, span := l.startSpan(ctx, "idemq.tx", req.Key)
	d := sharedtx.Delivery{Key: req.Key, TaskType: req.TaskType, Fingerprint: req.Fingerprint, IntentSum: req.intentSum(),
		Deadline: req.Deadline, Scope: req.Scope, Fn: fn}
	if sc := trace.SpanContextFromContext(ctx); sc.IsSampled() {
		d.TraceID = sc.TraceID().String()
	}
	o := l.tx.Run(ctx, d)
	c, res, err := l.settle(ctx, req, &o)
	endTxSpan(span, c, res, err)
	return res, err
}

// settle turns the outcome of req's transaction into DoTx's answer, and does what the
// transaction left to do: log a takeover, a result replaced by an error marker and a
// permanent failure left unrecorded, mark a stuck key, resolve a commit whose answer was
// lost. c is the claim that ran, if one did.
func (l *Ledger) settle(ctx context.Context, req Request, o *sharedtx.Outcome) (c *Claim, res Result, err error) {
	if o.Verdict == store.Claimed {
		r := &o.Row
		c = &Claim{Key: req.Key, TaskType: req.TaskType, Fence: r.Fence.Int64,
			Attempt: int(r.Attempts.Int32), Generation: int(r.Generation.Int32), owner: o.Owner, xid: o.XID, serverStart: o.ServerStart,
			taskID: req.TaskID, prevFence: r.PrevFence.Int64}
		if c.Attempt > 1 {
			l.tookOver(ctx, c)
		}
		if o.LastErr.Valid {
			l.badResult(ctx, c, o.LastErr.String)
		}
	}
	switch err = o.Err; {
	case err != nil:
	case o.Refused != nil:
		err = l.refused(ctx, req, o.Refused, c == nil)
	case c != nil:
		res = c.completed(o.Out, o.Stored, o.LastErr)
	default: // the read decided: a stored result, or why the key was not taken
		var cr ClaimResult
		var stuck int64
		cr, stuck, err = l.notTaken(req, o.Verdict, &o.Row)
		if stuck != 0 {
			l.markStuckOne(ctx, req, stuck)
		}
		if cr.Completed != nil {
			res = *cr.Completed
		}
	}
	if o.Lost != nil {
		// The resolution is a ledger write of its own, as in Complete: detached from the
		// caller, bounded by the write timeout, so that a commit lost on a connection that
		// no longer answers is unavailable soon rather than at the caller's deadline.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
		defer cancel()
		if lerr := l.commitLost(rctx, c, o.Lost); lerr != nil {
			return c, Result{}, asUnavailable(context.WithoutCancel(ctx), lerr)
		}
		if err == nil {
			l.observe(EventCompleted, req.TaskType)
		}
	}
	if o.Unrecorded != nil {
		l.log.WarnContext(ctx, "idempotency: record a permanent failure", "task_type", req.TaskType, "key", req.Key, "err", o.Unrecorded, "cause", err)
	}
	if err != nil {
		return c, Result{}, txUnavailable(ctx, err)
	}
	return c, res, nil
}

// txUnavailable marks err, a DoTx answer, as ErrUnavailable when it carries the error of
// one of the ledger's own statements (sharedtx.StatementError) that says Postgres could
// not be reached or did not answer in time, while caller, the DoTx call's context, has
// not ended. A handler's own errors (one it returns, a query of its own that timed out)
// do not carry that mark and stay as they are.
func txUnavailable(caller context.Context, err error) error {
	var own *sharedtx.StatementError
	if errors.Is(err, ErrUnavailable) || !errors.As(err, &own) || !unreachable(caller, own.Err) {
		return err
	}
	return &unavailableError{err: err}
}
