package idempotency

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemq/idemq/internal/pgcode"
)

// Claim is a live claim on a key: its identity (fence and owner) makes every later write
// conditional on still holding the key. A Claim is used by one goroutine at a time (Do
// heartbeats from a second goroutine but never at the same time as Complete or Fail).
type Claim struct {
	Key      string
	TaskType string
	// Fence is drawn from a global sequence for this claim; it is never handed out twice.
	Fence int64
	// Owner is a random id (a UUID) for this claim.
	Owner string
	// Attempt counts the claims of the key so far, this one included.
	Attempt int
	// Generation is bumped by each operator re-run.
	Generation int
	// LeaseUntil is when the lease ends, by the database clock, as of the claim.
	LeaseUntil time.Time

	owner    pgtype.UUID
	deadline time.Time
	sentAt   time.Time     // local (monotonic) time the claim was sent
	lease    time.Duration // the lease asked for at the claim
	xid      string        // DoTx: the claiming transaction's id
	// serverStart is pg_postmaster_start_time() when xid was drawn: after a restart an
	// xid whose records were lost may be handed out again, so it no longer identifies us.
	serverStart string
}

// ClaimResult is the outcome of a successful Ledger.Claim: exactly one field is set.
type ClaimResult struct {
	// Claim is set when this call took the key: run the work, then Complete or Fail.
	Claim *Claim
	// Completed is set when the key was already completed: its stored result, Cached.
	Completed *Result
}

// claimSQL claims a key in one statement. cur is a plain read of the row; gate says
// whether the row is absent or claimable (in progress, lease expired, younger than the
// maximum age, same fingerprint). Only then is the upsert attempted: a completed key is
// answered by the read without locking the row and without drawing a fence. The upsert
// re-checks everything on the newest row version (ON CONFLICT reads past the snapshot), so
// when it returns nothing the caller reads again.
//
// The statement also sets up its transaction, so that no round trip is spent on it: gate
// (evaluated before the upsert, which pulls its row from it) saves the session's
// lock_timeout and sets $8 (how long the upsert may wait for another session's row),
// turns synchronous_commit on and sets idle_in_transaction_session_timeout to $9; the
// final SELECT, evaluated after the upsert, restores lock_timeout, so that a DoTx
// handler's own waits are not cut short. Settings are local to the transaction.
//
// $7 is true for DoTx: the row (and the key's outbox intent) is written completed at once (the row lock, held until
// the transaction ends, is the lease, and nobody sees the row before it commits, with
// the effect, or rolls back with it), so the completion only has to store the result;
// and the transaction id comes back with the claim, for a commit whose answer is lost.
const claimSQL = `
WITH cur AS (
	SELECT status, fence, owner, payload_sha256, result, attempts, last_error,
	       locked_until, started_at, completed_at, generation
	FROM processed_jobs WHERE idempotency_key = $1
), gate AS (
	SELECT set_config('idemq.saved_lock_timeout', current_setting('lock_timeout'), true) AS saved,
	       set_config('lock_timeout', $8, true) AS lock_timeout,
	       set_config('synchronous_commit', 'on', true) AS synchronous_commit,
	       set_config('idle_in_transaction_session_timeout', $9, true) AS idle_timeout,
	       NOT EXISTS (
	           SELECT 1 FROM cur
	           WHERE NOT (status = 'in_progress' AND locked_until < now()
	                      AND started_at >= now() - $6::bigint * interval '1 microsecond'
	                      AND (payload_sha256 IS NULL OR $4::bytea IS NULL OR payload_sha256 = $4::bytea))
	       ) AS open
), up AS (
	INSERT INTO processed_jobs AS p
		(idempotency_key, task_type, status, fence, owner, payload_sha256, attempts, locked_until, completed_at)
	SELECT $1, $2, CASE WHEN $7::bool THEN 'completed' ELSE 'in_progress' END,
	       nextval('processed_jobs_fence_seq'), $3, $4::bytea, 1,
	       now() + $5::bigint * interval '1 microsecond', CASE WHEN $7::bool THEN now() END
	FROM gate WHERE gate.open
	ON CONFLICT (idempotency_key) DO UPDATE
	SET status = excluded.status, fence = excluded.fence, owner = excluded.owner, attempts = p.attempts + 1,
	    locked_until = excluded.locked_until, completed_at = excluded.completed_at, updated_at = now(),
	    payload_sha256 = coalesce(p.payload_sha256, excluded.payload_sha256)
	WHERE p.status = 'in_progress' AND p.locked_until < now()
	  AND p.started_at >= now() - $6::bigint * interval '1 microsecond'
	  AND (p.payload_sha256 IS NULL OR excluded.payload_sha256 IS NULL
	       OR p.payload_sha256 = excluded.payload_sha256)
	RETURNING p.status, p.fence, p.owner, p.payload_sha256, p.result, p.attempts, p.last_error,
	          p.locked_until, p.started_at, p.completed_at, p.generation
), intent AS (
	-- DoTx writes the row completed: settle the outbox intent in the same transaction.
	` + settleIntentSQL + `'done'
	WHERE $7::bool AND idempotency_key = $1 AND state IN ('pending', 'published') AND EXISTS (SELECT 1 FROM up)
)
SELECT true, true, up.*, now(), CASE WHEN $7::bool THEN pg_current_xact_id()::text END,
       pg_postmaster_start_time()::text,
       set_config('lock_timeout', current_setting('idemq.saved_lock_timeout'), true)
FROM up
UNION ALL
SELECT false, gate.open, cur.*, now(), NULL, NULL,
       set_config('lock_timeout', current_setting('idemq.saved_lock_timeout'), true)
FROM gate LEFT JOIN cur ON true
WHERE NOT EXISTS (SELECT 1 FROM up)`

// claimManySQL is claimSQL for a batch of keys in one statement (see committer): $1..$5
// are arrays with one element per key (key, task type, owner, fingerprint or NULL, lease
// in microseconds), $6 the maximum age, $7 true in a shared DoTx transaction, where the
// rows are written completed at once (as claimSQL's $7; the outbox intents are settled
// by finishTxManySQL). The lock_timeout is set before it, by claimSettingsSQL.
// Every answer row starts with the key's ordinal in the arrays, then claimSQL's columns.
// The settings are made once, before any row is locked; the upsert takes its rows in key
// order.
const claimManySQL = `
WITH req AS (
	SELECT * FROM unnest($1::text[], $2::text[], $3::uuid[], $4::bytea[], $5::bigint[]) WITH ORDINALITY
		AS req(key, task_type, owner, fp, lease_us, ord)
), settings AS (
	SELECT set_config('synchronous_commit', 'on', true) AS synchronous_commit
), cur AS (
	SELECT req.ord, p.status, p.fence, p.owner, p.payload_sha256, p.result, p.attempts, p.last_error,
	       p.locked_until, p.started_at, p.completed_at, p.generation
	FROM req JOIN processed_jobs p ON p.idempotency_key = req.key
), gate AS (
	SELECT req.*, NOT EXISTS (
	           SELECT 1 FROM cur
	           WHERE cur.ord = req.ord
	             AND NOT (status = 'in_progress' AND locked_until < now()
	                      AND started_at >= now() - $6::bigint * interval '1 microsecond'
	                      AND (payload_sha256 IS NULL OR req.fp IS NULL OR payload_sha256 = req.fp))
	       ) AS open
	FROM req
), up AS (
	INSERT INTO processed_jobs AS p
		(idempotency_key, task_type, status, fence, owner, payload_sha256, attempts, locked_until, completed_at)
	SELECT gate.key, gate.task_type, CASE WHEN $7::bool THEN 'completed' ELSE 'in_progress' END,
	       nextval('processed_jobs_fence_seq'), gate.owner, gate.fp, 1,
	       now() + gate.lease_us * interval '1 microsecond', CASE WHEN $7::bool THEN now() END
	FROM settings, gate WHERE gate.open
	ORDER BY gate.key
	ON CONFLICT (idempotency_key) DO UPDATE
	SET status = excluded.status, fence = excluded.fence, owner = excluded.owner, attempts = p.attempts + 1,
	    locked_until = excluded.locked_until, completed_at = excluded.completed_at, updated_at = now(),
	    payload_sha256 = coalesce(p.payload_sha256, excluded.payload_sha256)
	WHERE p.status = 'in_progress' AND p.locked_until < now()
	  AND p.started_at >= now() - $6::bigint * interval '1 microsecond'
	  AND (p.payload_sha256 IS NULL OR excluded.payload_sha256 IS NULL
	       OR p.payload_sha256 = excluded.payload_sha256)
	RETURNING p.idempotency_key, p.status, p.fence, p.owner, p.payload_sha256, p.result, p.attempts, p.last_error,
	          p.locked_until, p.started_at, p.completed_at, p.generation
)
SELECT req.ord, true, true, up.status, up.fence, up.owner, up.payload_sha256, up.result, up.attempts, up.last_error,
       up.locked_until, up.started_at, up.completed_at, up.generation, now(), NULL::text,
       pg_postmaster_start_time()::text, NULL::text
FROM up JOIN req ON req.key = up.idempotency_key
UNION ALL
SELECT gate.ord, false, gate.open, cur.status, cur.fence, cur.owner, cur.payload_sha256, cur.result, cur.attempts,
       cur.last_error, cur.locked_until, cur.started_at, cur.completed_at, cur.generation, now(), NULL, NULL, NULL
FROM gate LEFT JOIN cur ON cur.ord = gate.ord
WHERE NOT EXISTS (SELECT 1 FROM up WHERE up.idempotency_key = gate.key)`

// claimArgs is a claim's row in a claimManySQL batch.
type claimArgs struct {
	taskType string
	owner    pgtype.UUID
	fp       []byte
	leaseUS  int64
}

// claimManyArgs returns claimManySQL's arguments for batch.
func (l *Ledger) claimManyArgs(batch []*gcOp) []any {
	keys, types := make([]string, len(batch)), make([]string, len(batch))
	owners, fps, leases := make([]pgtype.UUID, len(batch)), make([][]byte, len(batch)), make([]int64, len(batch))
	for i, op := range batch {
		a := op.row.(*claimArgs)
		keys[i], types[i], owners[i], fps[i], leases[i] = op.key, a.taskType, a.owner, a.fp, a.leaseUS
	}
	return []any{keys, types, owners, fps, leases, l.cfg.MaxAge.Microseconds(), false}
}

// readRowSQL reads a row for a claim that lost a race, in the shape claimSQL returns.
const readRowSQL = `
SELECT false, false, status, fence, owner, payload_sha256, result, attempts, last_error,
       locked_until, started_at, completed_at, generation, now(), NULL::text, NULL::text, NULL::text
FROM processed_jobs WHERE idempotency_key = $1`

// markStuckOneSQL turns one expired, too old in-progress claim into needs_attention.
const markStuckOneSQL = `
UPDATE processed_jobs SET status = 'needs_attention', updated_at = now()
WHERE idempotency_key = $1 AND fence = $2 AND status = 'in_progress' AND locked_until < now()`

type claimRow struct {
	claimed, attempted bool
	status             pgtype.Text
	fence              pgtype.Int8
	owner              pgtype.UUID
	fingerprint        []byte
	result             []byte
	attempts           pgtype.Int4
	lastError          pgtype.Text
	lockedUntil        pgtype.Timestamptz
	startedAt          pgtype.Timestamptz
	completedAt        pgtype.Timestamptz
	generation         pgtype.Int4
	dbNow              time.Time
	xid                pgtype.Text
	serverStart        pgtype.Text
}

func (r *claimRow) scan(row pgx.Row) error { return row.Scan(r.targets()...) }

// targets are the scan destinations of claimSQL's columns, in order. lead, if any, go
// first (claimManySQL's rows start with the key's ordinal).
func (r *claimRow) targets(lead ...any) []any {
	return append(lead, &r.claimed, &r.attempted, &r.status, &r.fence, &r.owner, &r.fingerprint,
		&r.result, &r.attempts, &r.lastError, &r.lockedUntil, &r.startedAt, &r.completedAt,
		&r.generation, &r.dbNow, &r.xid, &r.serverStart, nil)
}

// maxClaimRounds bounds the re-reads after lost races; past it the key is reported busy.
const maxClaimRounds = 5

// Claim tries to take req.Key. On success exactly one of the result's fields is set: a
// new *Claim (run the work, then Complete or Fail it; Do does all of this), or the stored
// Result of a completed key. Otherwise the error is a *BusyError (ErrBusy: another claim
// holds the key, retry when it ends), a *FailedError (ErrFailed), a *MismatchError
// (ErrMismatch), or wraps ErrNeedsAttention, ErrInvalidKey, ErrInvalidRequest, a context
// error or a database error. A claim commits before Claim returns. Safe for concurrent
// use.
func (l *Ledger) Claim(ctx context.Context, req Request) (ClaimResult, error) {
	if err := req.validate(); err != nil {
		return ClaimResult{}, err
	}
	for round := 0; ; round++ {
		c, args, err := l.newClaim(req, false)
		if err != nil {
			return ClaimResult{}, err
		}
		var r claimRow
		if err := l.claimOne(ctx, req.Key, args, &r); err != nil {
			return ClaimResult{}, l.claimError(req, err)
		}
		if !r.claimed && r.attempted {
			// Lost a race with a concurrent change: look again with a fresh snapshot.
			err := r.scan(l.pool.QueryRow(ctx, readRowSQL, req.Key))
			if errors.Is(err, pgx.ErrNoRows) {
				r = claimRow{} // deleted meanwhile: decide counts it as a race
			} else if err != nil {
				return ClaimResult{}, fmt.Errorf("idempotency: claim %s: %w", req.Key, err)
			}
		}
		res, stuck, again, err := l.decide(req, c, &r, round)
		if stuck != 0 {
			l.markStuckOne(ctx, req, stuck)
		}
		if again {
			continue
		}
		return res, err
	}
}

// claimOne runs claimSQL with args (newClaim's) and reads its row into r: in a group
// commit (claimManySQL), or alone when group commit is off.
func (l *Ledger) claimOne(ctx context.Context, key string, args []any, r *claimRow) error {
	if l.cfg.DisableGroupCommit {
		return r.scan(l.pool.QueryRow(ctx, claimSQL, args...))
	}
	a := &claimArgs{taskType: args[1].(string), owner: args[2].(pgtype.UUID), leaseUS: args[4].(int64)}
	if fp, ok := args[3].([]byte); ok {
		a.fp = fp
	}
	answered := false
	err := l.claims.run(ctx, l, &gcOp{key: key, row: a,
		reset: func() { answered = false },
		read: func(rows pgx.Rows) error {
			answered = true
			return rows.Scan(r.targets(nil)...)
		}})
	if err == nil && !answered {
		err = fmt.Errorf("idempotency: claim %s: no answer for the key", key)
	}
	return err
}

// newClaim makes the identity of a claim attempt and the claimSQL arguments.
func (l *Ledger) newClaim(req Request, inTx bool) (*Claim, []any, error) {
	lease := l.leaseFor(req.Deadline)
	if lease <= 0 {
		return nil, nil, fmt.Errorf("idempotency: claim %s: the delivery deadline has passed: %w", req.Key, context.DeadlineExceeded)
	}
	c := &Claim{Key: req.Key, TaskType: req.TaskType, deadline: req.Deadline, lease: lease}
	if _, err := rand.Read(c.owner.Bytes[:]); err != nil {
		return nil, nil, fmt.Errorf("idempotency: owner id: %w", err)
	}
	c.owner.Bytes[6] = c.owner.Bytes[6]&0x0f | 0x40 // version 4
	c.owner.Bytes[8] = c.owner.Bytes[8]&0x3f | 0x80 // RFC 4122 variant
	c.owner.Valid = true
	c.Owner = formatUUID(c.owner.Bytes)
	c.sentAt = time.Now()
	var fp any
	if req.Fingerprint != nil {
		fp = req.Fingerprint
	}
	return c, []any{req.Key, req.TaskType, c.owner, fp, lease.Microseconds(), l.cfg.MaxAge.Microseconds(), inTx,
		l.lockTimeoutSQL, l.idleTimeout(req.Deadline)}, nil
}

// leaseFor is the lease to ask for: Config.Lease, cut to the time left before deadline.
func (l *Ledger) leaseFor(deadline time.Time) time.Duration {
	lease := l.cfg.Lease
	if !deadline.IsZero() {
		if left := time.Until(deadline); left < lease {
			lease = max(left, 0)
		}
	}
	return lease
}

// decide turns a claimSQL row into an outcome. stuck is a fence to mark needs_attention
// (after any transaction ends); again asks for another claim round.
func (l *Ledger) decide(req Request, c *Claim, r *claimRow, round int) (res ClaimResult, stuck int64, again bool, err error) {
	if r.claimed {
		c.Fence = r.fence.Int64
		c.Attempt = int(r.attempts.Int32)
		c.Generation = int(r.generation.Int32)
		c.LeaseUntil = r.lockedUntil.Time
		c.xid = r.xid.String
		c.serverStart = r.serverStart.String
		if c.Attempt > 1 {
			l.observe(EventTakeover, req.TaskType)
			l.log.Info("idempotency: took over an expired lease", "task_type", req.TaskType, "key", req.Key, "fence", c.Fence, "attempt", c.Attempt)
		} else {
			l.observe(EventClaimed, req.TaskType)
		}
		return ClaimResult{Claim: c}, 0, false, nil
	}
	if !r.status.Valid { // no row visible, yet the insert conflicted: a race
		return l.raceOrBusy(req, round)
	}
	if r.fingerprint != nil && req.Fingerprint != nil && !bytes.Equal(r.fingerprint, req.Fingerprint) {
		l.observe(EventMismatch, req.TaskType)
		return ClaimResult{}, 0, false, &MismatchError{Key: req.Key}
	}
	switch r.status.String {
	case StatusCompleted:
		l.observe(EventCacheHit, req.TaskType)
		return ClaimResult{Completed: &Result{
			Key: req.Key, Result: json.RawMessage(r.result), Cached: true, Fence: r.fence.Int64,
			Attempts: int(r.attempts.Int32), Generation: int(r.generation.Int32), CompletedAt: r.completedAt.Time,
		}}, 0, false, nil
	case StatusFailed:
		l.observe(EventFailedKey, req.TaskType)
		return ClaimResult{}, 0, false, &FailedError{Key: req.Key, LastError: r.lastError.String}
	case StatusNeedsAttention:
		l.observe(EventNeedsAttention, req.TaskType)
		return ClaimResult{}, 0, false, fmt.Errorf("%w: key %q", ErrNeedsAttention, req.Key)
	}
	// in progress
	if !r.lockedUntil.Time.Before(r.dbNow) {
		l.observe(EventBusy, req.TaskType)
		return ClaimResult{}, 0, false, &BusyError{Key: req.Key, Owner: formatUUID(r.owner.Bytes), Fence: r.fence.Int64, Until: r.lockedUntil.Time}
	}
	if r.startedAt.Time.Before(r.dbNow.Add(-l.cfg.MaxAge)) {
		l.observe(EventNeedsAttention, req.TaskType)
		return ClaimResult{}, r.fence.Int64, false, fmt.Errorf("%w: key %q in progress since %s, longer than the maximum age %s",
			ErrNeedsAttention, req.Key, r.startedAt.Time.UTC().Format(time.RFC3339), l.cfg.MaxAge)
	}
	return l.raceOrBusy(req, round)
}

func (l *Ledger) raceOrBusy(req Request, round int) (ClaimResult, int64, bool, error) {
	if round+1 < maxClaimRounds {
		return ClaimResult{}, 0, true, nil
	}
	l.observe(EventBusy, req.TaskType)
	return ClaimResult{}, 0, false, &BusyError{Key: req.Key}
}

func (l *Ledger) markStuckOne(ctx context.Context, req Request, fence int64) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
	defer cancel()
	if _, err := l.pool.Exec(ctx, markStuckOneSQL, req.Key, fence); err != nil {
		l.log.Warn("idempotency: mark needs_attention", "task_type", req.TaskType, "key", req.Key, "fence", fence, "err", err)
		return
	}
	l.log.Warn("idempotency: in progress past the maximum age; needs attention", "task_type", req.TaskType, "key", req.Key, "fence", fence)
}

// claimError translates a claim's database error: lock, serialization and deadlock
// failures mean another session holds the key.
func (l *Ledger) claimError(req Request, err error) error {
	if isRetryable(err) {
		l.observe(EventBusy, req.TaskType)
		return fmt.Errorf("%w: %w", &BusyError{Key: req.Key}, err)
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgcode.CheckViolation && (pgErr.ConstraintName == "processed_jobs_key_check" || pgErr.ConstraintName == "processed_jobs_key_no_hash_check") {
		return fmt.Errorf("%w: %w", ErrInvalidKey, err)
	}
	return fmt.Errorf("idempotency: claim %s: %w", req.Key, err)
}

// isRetryable reports serialization failures, deadlocks and lock timeouts.
func isRetryable(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code {
	case pgcode.SerializationFailure, pgcode.DeadlockDetected, pgcode.LockNotAvailable:
		return true
	}
	return false
}

// formatUUID writes b in the canonical 8-4-4-4-12 form.
func formatUUID(b [16]byte) string {
	var s [36]byte
	hex.Encode(s[0:8], b[0:4])
	s[8] = '-'
	hex.Encode(s[9:13], b[4:6])
	s[13] = '-'
	hex.Encode(s[14:18], b[6:8])
	s[18] = '-'
	hex.Encode(s[19:23], b[8:10])
	s[23] = '-'
	hex.Encode(s[24:], b[10:])
	return string(s[:])
}
