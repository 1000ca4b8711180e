package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency/internal/store"
)

// Heartbeat extends c's lease by Config.Lease from now (database clock), never past the
// request's Deadline and never shortening it, on the heartbeat pool. It returns the new
// lease end. ErrLeaseLost means the claim no longer holds the key: stop the work. Other
// errors (the database unreachable: ErrUnavailable) leave the lease as it was. Safe for concurrent use,
// but not concurrently with Complete or Fail on the same claim.
func (l *Ledger) Heartbeat(ctx context.Context, c *Claim) (time.Time, error) {
	lease := l.leaseFor(c.deadline)
	until, held, err := l.writes.ExtendLease(ctx, l.hbPool, c.Key, c.Fence, c.owner, lease)
	if err != nil {
		return time.Time{}, asUnavailable(ctx, fmt.Errorf("idempotency: heartbeat %s: %w", c.Key, err))
	}
	if !held {
		l.leaseLost(ctx, c, "heartbeat")
		return time.Time{}, fmt.Errorf("%w: heartbeat of key %q fence %d", ErrLeaseLost, c.Key, c.Fence)
	}
	return until, nil
}

func (l *Ledger) leaseLost(ctx context.Context, c *Claim, what string) {
	l.observe(EventLeaseLost, c.TaskType)
	l.recordClaim(HistoryLeaseLost, c, what+" refused")
	l.log.WarnContext(ctx, "idempotency: lease lost; "+what+" refused", "task_type", c.TaskType, "key", c.Key, "fence", c.Fence, "attempt", c.Attempt)
}

// Complete records result for c's key, durably (synchronous_commit on), if c still holds
// it; it returns an error wrapping ErrLeaseLost when it does not, and then nothing was
// recorded. A result that is not valid JSON jsonb accepts, or is larger than
// Config.MaxResultBytes, is replaced by an error marker ({"idemq_error":"..."}, also in
// last_error): the key still completes and never runs again. It runs detached from ctx's
// cancellation, bounded by Config.WriteTimeout. If the connection drops while committing,
// the outcome is learned from the transaction id; ErrCommitUnknown when it cannot be.
// An error that says Postgres could not be reached or did not answer within
// Config.WriteTimeout wraps ErrUnavailable.
func (l *Ledger) Complete(ctx context.Context, c *Claim, result json.RawMessage) error {
	_, err := l.complete(ctx, c, result)
	return err
}

// complete is Complete; it also returns the completed key's Result.
func (l *Ledger) complete(ctx context.Context, c *Claim, result json.RawMessage) (Result, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
	defer cancel()
	stored, lastErr := l.checkResult(ctx, c, result)
	res := c.completed(result, stored, lastErr)
	err := l.finish(ctx, c, store.ActionComplete, stored, lastErr)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code[:2] == store.DataExceptionClass && !lastErr.Valid {
		// The database refused the value after all (a data exception): store a marker.
		stored, lastErr = l.markResult(ctx, c, "result refused by the database: "+pgErr.Message)
		err = l.finish(ctx, c, store.ActionComplete, stored, lastErr)
	}
	if err != nil {
		return Result{}, err
	}
	l.observe(EventCompleted, c.TaskType)
	return res, nil
}

// Fail records cause for c's key. If IsPermanent(cause), the key becomes failed, a
// terminal state no delivery reopens (only Rerun does). Otherwise the lease ends at once
// (locked_until = now()), so the next delivery takes over with a new fence without
// waiting. attempts and last_error are kept. It returns an error wrapping ErrLeaseLost
// when c no longer holds the key. Like Complete it runs detached from ctx's cancellation,
// bounded by Config.WriteTimeout, and commits durably.
func (l *Ledger) Fail(ctx context.Context, c *Claim, cause error) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
	defer cancel()
	if cause == nil {
		cause = errors.New("unknown error")
	}
	msg := pgtype.Text{String: cleanText(cause.Error()), Valid: true}
	action, ev := store.ActionRetry, EventRetry
	if IsPermanent(cause) {
		action, ev = store.ActionFail, EventFailed
	}
	if err := l.finish(ctx, c, action, pgtype.Text{}, msg); err != nil {
		return err
	}
	l.observe(ev, c.TaskType)
	return nil
}

// finish ends c's claim with one fenced update (see store.FinishMany), durably: in a
// round of the leased committer, shared with whatever other completions and failures are
// being committed, or alone with Config.DisableGroupCommit. It returns once the round's
// commit is durable. The update's answer carries its transaction id, read before the
// commit is asked for, which resolves a commit whose answer was lost. ctx is the write's
// own (Complete and Fail detach it from their caller): its timeout, like a lost or refused
// connection, makes the error ErrUnavailable.
func (l *Ledger) finish(ctx context.Context, c *Claim, action store.Action, result, errMsg pgtype.Text) error {
	return asUnavailable(context.WithoutCancel(ctx), l.finishOnce(ctx, c, action, result, errMsg))
}

func (l *Ledger) finishOnce(ctx context.Context, c *Claim, action store.Action, result, errMsg pgtype.Text) error {
	op := &leasedOp{key: c.Key, finish: &store.FinishParams{Key: c.Key, Fence: c.Fence, Owner: c.owner, Action: action, Result: result, Error: errMsg,
		IntentSum: c.intentSum},
		span: trace.SpanFromContext(ctx)}
	err := l.leased.Run(ctx, laneFinish, op)
	if err != nil && !op.lost && pgconn.SafeToRetry(err) {
		// Nothing reached the server (connections left over from before a restart).
		err = l.leased.Run(ctx, laneFinish, op)
	}
	switch {
	case err != nil && op.lost && op.answered:
		c.xid, c.serverStart = op.finished.XID, op.finished.ServerStart
		return l.commitLost(ctx, c, err)
	case err != nil && !op.lost:
		return fmt.Errorf("idempotency: finish %s: %w", c.Key, err)
	case !op.answered: // the update matched no row, whatever became of the commit
		l.leaseLost(ctx, c, "write")
		return fmt.Errorf("%w: key %q fence %d", ErrLeaseLost, c.Key, c.Fence)
	}
	return nil
}
