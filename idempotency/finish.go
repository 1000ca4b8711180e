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
	"github.com/jackc/pgx/v5/pgtype"
)

// heartbeatSQL extends a claim's lease ($4 µs from now, never shortening it), fenced.
func heartbeatSQL(f fenceChecks) string {
	return `
UPDATE processed_jobs
SET locked_until = greatest(locked_until, now() + $4::bigint * interval '1 microsecond'), updated_at = now()
WHERE idempotency_key = $1 AND ` + f.args + ` AND status = 'in_progress'
RETURNING locked_until`
}

// Heartbeat extends c's lease by Config.Lease from now (database clock), never past the
// request's Deadline and never shortening it, on the heartbeat pool. It returns the new
// lease end. ErrLeaseLost means the claim no longer holds the key: stop the work. Other
// errors (the database unreachable) leave the lease as it was. Safe for concurrent use,
// but not concurrently with Complete or Fail on the same claim.
func (l *Ledger) Heartbeat(ctx context.Context, c *Claim) (time.Time, error) {
	lease := l.leaseFor(c.deadline)
	var until time.Time
	err := l.hbPool.QueryRow(ctx, l.sql.heartbeat, c.Key, c.Fence, c.owner, lease.Microseconds()).Scan(&until)
	if errors.Is(err, pgx.ErrNoRows) {
		l.leaseLost(c, "heartbeat")
		return time.Time{}, fmt.Errorf("%w: heartbeat of key %q fence %d", ErrLeaseLost, c.Key, c.Fence)
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("idempotency: heartbeat %s: %w", c.Key, err)
	}
	return until, nil
}

func (l *Ledger) leaseLost(c *Claim, what string) {
	l.observe(EventLeaseLost, c.TaskType)
	l.log.Warn("idempotency: lease lost; "+what+" refused", "task_type", c.TaskType, "key", c.Key, "fence", c.Fence, "attempt", c.Attempt)
}

// The fenced updates that end a claim ($1 key, $2 fence, $3 owner). Each returns the
// transaction id before committing (see finish), and turns synchronous_commit on for the
// commit that follows. A completion settles the key's outbox intent (done; dead for a
// permanent failure) in the same statement, so the two commit together.
const (
	xidColumns = `pg_current_xact_id()::text, pg_postmaster_start_time()::text, set_config('synchronous_commit', 'on', true)`

	// settleIntentSQL is completed by a state and a WHERE clause.
	settleIntentSQL = `UPDATE job_intents SET finished_at = now(), updated_at = now(), state = `
)

func completeSQL(f fenceChecks) string {
	return `
WITH c AS (
	UPDATE processed_jobs
	SET status = 'completed', result = $4, last_error = coalesce($5, last_error), completed_at = now(), updated_at = now()
	WHERE idempotency_key = $1 AND ` + f.args + ` AND status = 'in_progress'
	RETURNING idempotency_key
), i AS (` + settleIntentSQL + `'done' WHERE idempotency_key IN (SELECT idempotency_key FROM c) AND state IN ('pending', 'published'))
SELECT ` + xidColumns + ` FROM c`
}

func failRetrySQL(f fenceChecks) string {
	return `
UPDATE processed_jobs SET locked_until = now(), last_error = $4, updated_at = now()
WHERE idempotency_key = $1 AND ` + f.args + ` AND status = 'in_progress'
RETURNING ` + xidColumns
}

func failPermanentSQL(f fenceChecks) string {
	return `
WITH c AS (
	UPDATE processed_jobs SET status = 'failed', last_error = $4, completed_at = now(), updated_at = now()
	WHERE idempotency_key = $1 AND ` + f.args + ` AND status = 'in_progress'
	RETURNING idempotency_key
), i AS (` + settleIntentSQL + `'dead' WHERE idempotency_key IN (SELECT idempotency_key FROM c) AND state IN ('pending', 'published'))
SELECT ` + xidColumns + ` FROM c`
}

// Complete records result for c's key, durably (synchronous_commit on), if c still holds
// it; it returns an error wrapping ErrLeaseLost when it does not, and then nothing was
// recorded. A result that is not valid JSON jsonb accepts, or is larger than
// Config.MaxResultBytes, is replaced by an error marker ({"idemq_error":"..."}, also in
// last_error): the key still completes and never runs again. It runs detached from ctx's
// cancellation, bounded by Config.WriteTimeout. If the connection drops while committing,
// the outcome is learned from the transaction id; ErrCommitUnknown when it cannot be.
func (l *Ledger) Complete(ctx context.Context, c *Claim, result json.RawMessage) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
	defer cancel()
	stored, lastErr := l.checkResult(c, result)
	err := l.finish(ctx, c, "idemq_complete", l.sql.complete, stored, lastErr)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code[:2] == "22" && lastErr == nil {
		// The database refused the value after all (a data exception): store a marker.
		stored, lastErr = l.markResult(c, "result refused by the database: "+pgErr.Message)
		err = l.finish(ctx, c, "idemq_complete", l.sql.complete, stored, lastErr)
	}
	if err == nil {
		l.observe(EventCompleted, c.TaskType)
	}
	return err
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
	msg := cleanText(cause.Error())
	name, q, ev := "idemq_fail_retry", l.sql.failRetry, EventRetry
	if IsPermanent(cause) {
		name, q, ev = "idemq_fail_permanent", l.sql.failPermanent, EventFailed
	}
	if err := l.finish(ctx, c, name, q, msg); err != nil {
		return err
	}
	l.observe(ev, c.TaskType)
	return nil
}

// finishActions names each fenced update's action in finishManySQL.
var finishActions = map[string]string{"idemq_complete": "complete", "idemq_fail_retry": "retry", "idemq_fail_permanent": "fail"}

// finish runs one fenced update (key, fence, owner, then text arguments or nil) that
// returns the transaction id, committing durably. It is one statement in an implicit
// transaction of the extended protocol: the update is sent with a Flush, which makes the
// server answer (with the transaction id) but keeps the transaction open; the Sync sent
// next commits it. So the id is known before the commit is asked for, and resolves a
// commit whose answer was lost, at the cost of no BEGIN or COMMIT statement.
func (l *Ledger) finish(ctx context.Context, c *Claim, name, q string, args ...any) error {
	err := l.finishOnce(ctx, c, name, q, args...)
	if err != nil && pgconn.SafeToRetry(err) {
		// Nothing reached the server (a connection left over from before a restart).
		err = l.finishOnce(ctx, c, name, q, args...)
	}
	return err
}

func (l *Ledger) finishOnce(ctx context.Context, c *Claim, name, q string, args ...any) error {
	if !l.cfg.DisableGroupCommit {
		return l.finishGrouped(ctx, c, finishActions[name], args...)
	}
	conn, err := l.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("idempotency: finish %s: %w", c.Key, err)
	}
	defer conn.Release()
	var sd *pgconn.StatementDescription
	if l.prepare {
		if l.cfg.UnsafeNoFencing {
			name += "_nofence"
		}
		if sd, err = conn.Conn().Prepare(ctx, name, q); err != nil { // once per connection
			return fmt.Errorf("idempotency: finish %s: %w", c.Key, err)
		}
	}
	params := [][]byte{[]byte(c.Key), strconv.AppendInt(nil, c.Fence, 10), []byte(c.Owner)}
	for _, a := range args {
		if s, ok := a.(string); ok {
			params = append(params, []byte(s))
		} else {
			params = append(params, nil)
		}
	}

	pipe := conn.Conn().PgConn().StartPipeline(ctx)
	defer pipe.Close()
	if sd != nil {
		pipe.SendQueryStatement(sd, params, nil, nil) // text formats
	} else {
		pipe.SendQueryParams(q, params, nil, nil, nil) // unnamed, text formats
	}
	pipe.SendFlushRequest()
	updated := false
	err = pipe.Flush()
	if err == nil {
		var res any
		if res, err = pipe.GetResults(); err == nil {
			rr, ok := res.(*pgconn.ResultReader)
			if !ok {
				err = fmt.Errorf("unexpected pipeline result %T", res)
			} else {
				for rr.NextRow() {
					v := rr.Values()
					c.xid, c.serverStart, updated = string(v[0]), string(v[1]), true
				}
				_, err = rr.Close()
			}
		}
	}
	if err != nil {
		if !conn.Conn().PgConn().IsClosed() {
			pipe.Sync() // ends (rolls back) the implicit transaction; Close reads the answer
		}
		return fmt.Errorf("idempotency: finish %s: %w", c.Key, err)
	}
	if !updated {
		// Nothing changed: the commit that the Sync does is empty.
		pipe.Sync()
		l.leaseLost(c, "write")
		return fmt.Errorf("%w: key %q fence %d", ErrLeaseLost, c.Key, c.Fence)
	}
	err = pipe.Sync()
	if err == nil {
		var res any
		res, err = pipe.GetResults()
		if _, ok := res.(*pgconn.PipelineSync); err == nil && !ok {
			err = fmt.Errorf("idempotency: finish %s: unexpected pipeline result %T", c.Key, res)
		}
	}
	if err != nil {
		return l.commitLost(ctx, c, err)
	}
	return nil
}

// finishManySQL ends a batch of claims in one statement (see committer): $1..$6 are
// arrays with one element per claim (key, fence, owner, action, result, error), where
// action is 'complete' (as completeSQL), 'retry' (failRetrySQL) or 'fail'
// (failPermanentSQL). Each row is updated only if its claim still holds it; every row
// that was comes back with its ordinal and the transaction id (see finish). Completions
// and permanent failures settle their outbox intents in the same statement.
func finishManySQL(f fenceChecks) string {
	return `
WITH r AS (
	SELECT * FROM unnest($1::text[], $2::bigint[], $3::uuid[], $4::text[], $5::text[], $6::text[]) WITH ORDINALITY
		AS r(key, fence, owner, action, result, error, ord)
), c AS (
	UPDATE processed_jobs p
	SET status = CASE r.action WHEN 'complete' THEN 'completed' WHEN 'fail' THEN 'failed' ELSE p.status END,
	    result = CASE WHEN r.action = 'complete' THEN r.result::jsonb ELSE p.result END,
	    last_error = CASE WHEN r.action = 'complete' THEN coalesce(r.error, p.last_error) ELSE r.error END,
	    completed_at = CASE WHEN r.action = 'retry' THEN p.completed_at ELSE now() END,
	    locked_until = CASE WHEN r.action = 'retry' THEN now() ELSE p.locked_until END,
	    updated_at = now()
	FROM r
	WHERE p.idempotency_key = r.key AND ` + f.rows + ` AND p.status = 'in_progress'
	RETURNING r.ord, p.idempotency_key, p.status
), i AS (
	UPDATE job_intents j SET finished_at = now(), updated_at = now(),
	       state = CASE WHEN c.status = 'completed' THEN 'done' ELSE 'dead' END
	FROM c
	WHERE j.idempotency_key = c.idempotency_key AND c.status IN ('completed', 'failed')
	  AND j.state IN ('pending', 'published')
)
SELECT c.ord, ` + xidColumns + ` FROM c`
}

// finishTxManySQL ends the rows of a shared DoTx transaction, which claimManySQL wrote
// completed ($1..$5: key, fence, owner, action, error): 'complete' keeps the row (its
// result is already stored, fenced, by storeResultTxSQL), 'fail' records a permanent
// failure, 'forget' undoes the claim of a handler that failed (the row it inserted is
// deleted; a taken-over one is back in progress, its lease ended). Completions and
// failures settle their outbox intents. Every row still held comes back with its ordinal
// and the transaction id.
func finishTxManySQL(f fenceChecks) string {
	return `
WITH r AS (
	SELECT * FROM unnest($1::text[], $2::bigint[], $3::uuid[], $4::text[], $5::text[]) WITH ORDINALITY
		AS r(key, fence, owner, action, error, ord)
), k AS (
	SELECT r.ord, r.key, r.action FROM r JOIN processed_jobs p
	  ON p.idempotency_key = r.key AND ` + f.rows + ` AND p.status = 'completed'
	WHERE r.action = 'complete'
), f AS (
	UPDATE processed_jobs p SET status = 'failed', last_error = r.error, updated_at = now()
	FROM r
	WHERE r.action = 'fail' AND p.idempotency_key = r.key AND ` + f.rows + ` AND p.status = 'completed'
	RETURNING r.ord, r.key, r.action
), g AS (
	UPDATE processed_jobs p SET status = 'in_progress', completed_at = NULL, locked_until = now(), updated_at = now()
	FROM r
	WHERE r.action = 'forget' AND NOT (p.attempts = 1 AND p.generation = 0)
	  AND p.idempotency_key = r.key AND ` + f.rows + ` AND p.status = 'completed'
	RETURNING r.ord
), d AS (
	DELETE FROM processed_jobs p USING r
	WHERE r.action = 'forget' AND p.attempts = 1 AND p.generation = 0
	  AND p.idempotency_key = r.key AND ` + f.rows + ` AND p.status = 'completed'
	RETURNING r.ord
), i AS (
	UPDATE job_intents j SET finished_at = now(), updated_at = now(),
	       state = CASE WHEN x.action = 'complete' THEN 'done' ELSE 'dead' END
	FROM (SELECT key, action FROM k UNION ALL SELECT key, action FROM f) x
	WHERE j.idempotency_key = x.key AND j.state IN ('pending', 'published')
), held AS (
	-- Every completed or failed row must still be ours; if not, the statement fails
	-- (division by zero) and the COMMIT sent after it cannot commit.
	SELECT 1 / (CASE WHEN (SELECT count(*) FROM k) + (SELECT count(*) FROM f)
	                    = (SELECT count(*) FROM r WHERE action IN ('complete', 'fail')) THEN 1 ELSE 0 END) AS ok
)
SELECT ord, ` + xidColumns + ` FROM held, (SELECT ord FROM k UNION ALL SELECT ord FROM f UNION ALL SELECT ord FROM g UNION ALL SELECT ord FROM d) e`
}

// finishArgs is a claim's row in a finishManySQL batch.
type finishArgs struct {
	fence          int64
	owner          pgtype.UUID
	action         string
	result, errMsg pgtype.Text
}

// finishManyArgs returns finishManySQL's arguments for batch.
func finishManyArgs(batch []*gcOp) []any {
	keys, fences, owners := make([]string, len(batch)), make([]int64, len(batch)), make([]pgtype.UUID, len(batch))
	actions, results, errs := make([]string, len(batch)), make([]pgtype.Text, len(batch)), make([]pgtype.Text, len(batch))
	for i, op := range batch {
		a := op.row.(*finishArgs)
		keys[i], fences[i], owners[i], actions[i], results[i], errs[i] = op.key, a.fence, a.owner, a.action, a.result, a.errMsg
	}
	return []any{keys, fences, owners, actions, results, errs}
}

// finishGrouped is finishOnce in a group commit: the fenced update joins whatever other
// completions and failures are being committed, and returns once their shared commit is
// durable. action is 'complete' (args: result, error), 'retry' or 'fail' (args: error).
func (l *Ledger) finishGrouped(ctx context.Context, c *Claim, action string, args ...any) error {
	a := &finishArgs{fence: c.Fence, owner: c.owner, action: action}
	text := func(v any) pgtype.Text {
		s, ok := v.(string)
		return pgtype.Text{String: s, Valid: ok}
	}
	if action == "complete" {
		a.result, a.errMsg = text(args[0]), text(args[1])
	} else {
		a.errMsg = text(args[0])
	}
	updated := false
	op := &gcOp{key: c.Key, row: a,
		reset: func() { updated = false },
		read: func(rows pgx.Rows) error {
			updated = true
			return rows.Scan(nil, &c.xid, &c.serverStart, nil)
		}}
	err := l.finishes.run(ctx, l, op)
	switch {
	case err != nil && op.sent && updated:
		return l.commitLost(ctx, c, err)
	case err != nil && !op.sent:
		return fmt.Errorf("idempotency: finish %s: %w", c.Key, err)
	case !updated: // the update matched no row, whatever became of the commit
		l.leaseLost(c, "write")
		return fmt.Errorf("%w: key %q fence %d", ErrLeaseLost, c.Key, c.Fence)
	}
	return nil
}
