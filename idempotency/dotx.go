package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/idemq/idemq/idempotency/internal/pgcode"
	"github.com/idemq/idemq/idempotency/internal/sharedtx"
	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
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
// (txshim: the time its queries take does not count) run in transactions of their own,
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
// IsPermanent(err), the key is recorded as failed (in the shared transaction's last
// statement; in a transaction of its own, by a claim and Fail, as in leased mode), so no
// delivery runs it again. When fn panics, the transaction rolls back and DoTx panics
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
	d := &txDelivery{l: l, req: req, ctx: ctx}
	res, err := l.settle(ctx, d, l.tx.Run(ctx, d, fn))
	endTxSpan(span, d.claim, res, err)
	return res, err
}

// txDelivery is one DoTx call, as the executor (sharedtx) sees it: its request, and what
// its transaction decided (the claim, the result, a stuck fence).
type txDelivery struct {
	l     *Ledger
	ctx   context.Context // the call's, for its log lines
	req   Request
	claim *Claim
	found bool   // the claim's read found a row (taken over)
	trace string // the claiming delivery's trace id
	res   Result
	stuck int64 // a fence to mark needs_attention
}

func (d *txDelivery) Key() string         { return d.req.Key }
func (d *txDelivery) TaskType() string    { return d.req.TaskType }
func (d *txDelivery) Deadline() time.Time { return d.req.Deadline }
func (d *txDelivery) Scope() string       { return d.req.Scope }

func (d *txDelivery) Claim(int) (store.ClaimParams, error) {
	c, p, err := d.l.newClaim(d.ctx, d.req)
	d.claim, d.trace, d.res, d.stuck = c, p.TraceID, Result{}, 0
	return p, err
}

func (d *txDelivery) Decide(r *store.ClaimRow, round int) (claimed, again bool, err error) {
	cr, stuck, again, err := d.l.decide(d.ctx, d.req, d.claim, r, round)
	d.stuck, d.found = stuck, r.Status.Valid
	if cr.Completed != nil {
		d.res = *cr.Completed
	}
	return cr.Claim != nil, again, err
}

// ClaimRefused is the error of a claim the server refused, or of one whose finish kept
// finding the key's row changed since its read (busy: another claim takes the key).
func (d *txDelivery) ClaimRefused(err error) error {
	if store.Conflict(err) {
		d.l.observe(EventBusy, d.req.TaskType)
		return &BusyError{Key: d.req.Key}
	}
	return asUnavailable(d.ctx, d.l.claimError(d.req, err))
}

func (d *txDelivery) Identity() store.FinishParams {
	c := d.claim
	return store.FinishParams{Key: c.Key, Fence: c.Fence, Owner: c.owner, IntentSum: c.intentSum, Found: d.found,
		TaskType: d.req.TaskType, Fingerprint: d.req.Fingerprint, Attempt: c.Attempt, Generation: c.Generation, TraceID: d.trace}
}

func (d *txDelivery) Check(out json.RawMessage) (stored, lastErr pgtype.Text) {
	stored, lastErr = d.l.checkResult(d.ctx, d.claim, out)
	d.res = d.claim.completed(out, stored, lastErr)
	return stored, lastErr
}

// Refused is the error of a delivery whose row the database refused: a result jsonb
// refuses (a data exception), which is recorded for good; a key a constraint refuses; a
// row another session kept locked past Config.ClaimLockTimeout (busy).
func (d *txDelivery) Refused(pgErr *pgconn.PgError) error {
	c := d.claim
	switch {
	case pgErr.Code[:2] == pgcode.DataExceptionClass:
		return Permanent(fmt.Errorf("idempotency: result refused by the database: %s", pgErr.Message))
	case pgErr.Code == pgcode.CheckViolation || isRetryable(pgErr):
		return d.l.claimError(d.req, pgErr) // an invalid key; busy: a row lock waited for too long
	}
	return asUnavailable(d.ctx, fmt.Errorf("idempotency: complete %s: %w", c.Key, pgErr))
}

func (d *txDelivery) Committed(xid, serverStart string) {
	d.claim.xid, d.claim.serverStart = xid, serverStart
}

func (d *txDelivery) Context(ctx context.Context) context.Context {
	return withClaim(ctx, d.claim.Key, d.claim.Fence)
}

// settle finishes what a DoTx answer leaves to its caller: a stuck key to mark, a commit
// whose answer was lost to resolve, a permanent failure to record.
func (l *Ledger) settle(ctx context.Context, d *txDelivery, a sharedtx.Answer) (Result, error) {
	if d.stuck != 0 {
		l.markStuckOne(ctx, d.req, d.stuck)
	}
	if a.Lost != nil {
		// The resolution is a ledger write of its own, as in Complete: detached from the
		// caller, bounded by the write timeout, so that a commit lost on a connection that
		// no longer answers is unavailable soon rather than at the caller's deadline.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
		defer cancel()
		if err := l.commitLost(rctx, d.claim, a.Lost); err != nil {
			return Result{}, asUnavailable(context.WithoutCancel(ctx), err)
		}
		if a.Err == nil {
			l.observe(EventCompleted, d.req.TaskType)
		}
	}
	if IsPermanent(a.Err) && !a.Recorded {
		l.recordPermanent(ctx, d.req, a.Err)
	}
	if a.Err != nil {
		return Result{}, txUnavailable(ctx, a.Err)
	}
	return d.res, nil
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
		l.log.WarnContext(ctx, "idempotency: record a permanent failure", "task_type", req.TaskType, "key", req.Key, "err", err, "cause", cause)
	}
}
