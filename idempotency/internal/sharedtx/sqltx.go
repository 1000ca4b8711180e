package sharedtx

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemq/idemq/idempotency/internal/claimctx"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// SQLFn is a delivery's work on a database/sql transaction (DoSQLTx).
type SQLFn func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error)

// RunSQL runs d, whose work is d.SQL, in a transaction of its own on db, on the caller's
// goroutine: the simple path of a DoTx delivery, over database/sql. The transaction
// begins, holds and reads the key (three round trips: database/sql sends one statement
// at a time), runs d.SQL, then writes the row and commits (three more). A finish that
// finds the row changed since the read runs d again, up to requeueRounds (then the key is
// busy, store.Race). A panic of d.SQL is raised again after the rollback.
func (e *Exec) RunSQL(ctx context.Context, db *sql.DB, d Delivery) Outcome {
	for round := 0; ; round++ {
		o, conflict := e.runSQL(ctx, db, d)
		switch {
		case !conflict:
			return o
		case round+1 >= requeueRounds:
			o.Verdict = store.Race
			return o
		}
	}
}

// runSQL is one claim round of RunSQL; conflict reports a finish refused because the row
// changed since the read (nothing committed).
func (e *Exec) runSQL(ctx context.Context, db *sql.DB, d Delivery) (o Outcome, conflict bool) {
	if err := ctx.Err(); err != nil {
		return Outcome{Err: fmt.Errorf("idempotency: claim %s: %w", d.Key, err)}, false
	}
	if dl := d.Deadline; !dl.IsZero() && !time.Now().Before(dl) {
		return Outcome{Err: fmt.Errorf("idempotency: claim %s: the delivery deadline has passed: %w", d.Key, context.DeadlineExceeded)}, false
	}
	tx, stop, o, claimed := e.claimSQL(ctx, db, d, pgtype.UUID{})
	if !claimed {
		return o, false
	}
	defer stop()
	out, err := e.runSQLFn(ctx, d, tx, o.Row.Fence.Int64)
	if err != nil {
		_ = tx.Rollback()
		if e.cfg.Permanent(err) {
			return e.recordSQL(ctx, db, d, o, failed(err.Error(), err)), false
		}
		o.Err = err
		return o, false
	}
	o.Out = out
	o.Stored, o.LastErr = store.ResultText(out, e.cfg.MaxResultBytes)
	if o.LastErr.Valid {
		e.observeType(EventBadResult, d.TaskType)
	}
	err, commitErr := e.finishSQL(ctx, tx, stop, finishParams(&d, &o, finish{action: store.ActionComplete}))
	switch {
	case store.Conflict(err):
		e.observeType(EventConflict, d.TaskType)
		return o, true
	case err != nil && store.Answered(err):
		o.Refused = err
		if pe := asPgError(err); pe.Code[:2] == store.DataExceptionClass {
			return e.recordSQL(ctx, db, d, o, failed(refusedResult+pe.Message, nil)), false
		}
	case err != nil:
		o.Err = own(fmt.Errorf("idempotency: DoSQLTx %s: the transaction did not commit; nothing recorded: %w", d.Key, err))
	case commitErr != nil && store.Answered(commitErr):
		o.Err = own(fmt.Errorf("idempotency: DoSQLTx %s: the transaction did not commit; nothing recorded: %w", d.Key, commitErr))
	case commitErr != nil:
		o.Lost = commitErr // settled from the transaction id
	default:
		e.observeType(EventCompleted, d.TaskType)
	}
	return o, false
}

// claimSQL begins a transaction and holds and reads d's key, as owner when it is valid
// (else a new one). claimed: the key is taken, tx is open (stop ends its life, see
// finishSQL) and o carries the read; otherwise tx is closed and o answers d.
func (e *Exec) claimSQL(ctx context.Context, db *sql.DB, d Delivery, owner pgtype.UUID) (tx *sql.Tx, stop func(), o Outcome, claimed bool) {
	o.Owner = owner
	if !o.Owner.Valid {
		owner, err := store.NewOwner()
		if err != nil {
			return nil, nil, Outcome{Err: fmt.Errorf("idempotency: owner id: %w", err)}, false
		}
		o.Owner = owner
	}
	// The transaction lives until it is ended, or its COMMIT runs past the write timeout
	// (finishSQL); each statement of the claim is bounded like a round trip of DoTx's.
	txCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.WriteTimeout+e.cfg.ClaimLockTimeout)
	tx, t, err := e.cfg.Writes.BeginClaimSQL(wctx, txCtx, db, e.idleTimeout(d.Deadline), e.lockTimeoutSQL,
		store.ClaimParams{Key: d.Key, TaskType: d.TaskType, Owner: o.Owner, Fingerprint: d.Fingerprint, TraceID: d.TraceID}, e.cfg.MaxAge)
	cancel()
	switch {
	case err != nil && store.Answered(err):
		stop()
		o.Refused = err
		return nil, nil, o, false
	case err != nil && ctx.Err() != nil:
		stop()
		return nil, nil, Outcome{Err: fmt.Errorf("idempotency: claim %s: %w", d.Key, ctx.Err())}, false
	case err != nil:
		stop()
		return nil, nil, Outcome{Err: own(fmt.Errorf("idempotency: claim %s: %w", d.Key, err))}, false
	}
	o.XID, o.ServerStart = t.XID, t.ServerStart
	r := t.Rows[0]
	o.Row, o.Verdict = r, r.Verdict(d.Fingerprint, e.cfg.MaxAge)
	if o.Verdict != store.Claimed {
		_ = tx.Rollback()
		stop()
		return nil, nil, o, false
	}
	if r.Attempts.Int32 > 1 {
		e.observeType(EventTakeover, d.TaskType)
	} else {
		e.observeType(EventClaimed, d.TaskType)
	}
	return tx, stop, o, true
}

// runSQLFn runs d.SQL on tx with the claim in its ctx. A panic rolls tx back and is
// raised again; a handler that ended tx itself fails (its effect may have committed
// without the key's row: that is the handler's bug, and it is said loudly).
func (e *Exec) runSQLFn(ctx context.Context, d Delivery, tx *sql.Tx, fence int64) (out json.RawMessage, err error) {
	panicked := true
	defer func() {
		if panicked {
			_ = tx.Rollback()
		}
	}()
	out, err = d.SQL(claimctx.WithTx(ctx, d.Key, fence), tx)
	panicked = false
	return out, err
}

// finishSQL writes p's row and commits, cutting the COMMIT at the write timeout: stop
// ends the transaction's context, and pgx's stdlib then drops the connection (the
// answer is lost, resolved from the transaction id). lib/pq only asks the server to
// cancel: on a network gone silent its call waits until TCP gives up. err is the
// finish's (the transaction rolled back), commitErr the COMMIT's.
func (e *Exec) finishSQL(ctx context.Context, tx *sql.Tx, stop func(), p store.FinishParams) (err, commitErr error) {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.WriteTimeout+e.cfg.ClaimLockTimeout)
	defer cancel()
	cut := time.AfterFunc(e.cfg.WriteTimeout+e.cfg.ClaimLockTimeout, stop)
	defer cut.Stop()
	err, commitErr = e.cfg.Writes.FinishSQL(wctx, tx, e.lockTimeoutSQL, p)
	if errors.Is(err, sql.ErrTxDone) {
		err = fmt.Errorf("idempotency: DoSQLTx %s: the handler ended the transaction (tx.Commit or tx.Rollback): its effect is not guarded and may have committed without the key's row: %w", p.Key, err)
	}
	if err != nil {
		_ = tx.Rollback()
	}
	return err, commitErr
}

// recordSQL writes d's row failed (f) after its handler failed for good in a transaction
// that rolled back: in a new transaction that holds and reads the key again, as
// DoTx's record does (see batch.record). failure is the outcome so far.
func (e *Exec) recordSQL(ctx context.Context, db *sql.DB, d Delivery, failure Outcome, f finish) Outcome {
	unrecorded := func(err error) Outcome {
		o := failure
		o.Unrecorded, o.Err = err, f.err
		return o
	}
	tx, stop, o, claimed := e.claimSQL(ctx, db, d, failure.Owner)
	switch {
	case o.Err != nil:
		return unrecorded(o.Err)
	case !claimed:
		return o // the read answers, or the server refused it
	}
	defer stop()
	o.Refused = failure.Refused
	err, commitErr := e.finishSQL(ctx, tx, stop, finishParams(&d, &o, f))
	switch {
	case err != nil:
		if store.Conflict(err) {
			e.observeType(EventConflict, d.TaskType)
		}
		return unrecorded(err)
	case commitErr != nil && store.Answered(commitErr):
		return unrecorded(commitErr)
	case commitErr != nil:
		o.Lost = commitErr
	default:
		e.observeType(EventFailed, d.TaskType)
	}
	o.Recorded, o.Err = true, f.err
	return o
}

// asPgError is the server's error err carries (store.Answered is true).
func asPgError(err error) *pgconn.PgError {
	var pe *pgconn.PgError
	errors.As(err, &pe)
	return pe
}
