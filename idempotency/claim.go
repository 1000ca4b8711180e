package idempotency

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency/internal/store"
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
	// intentSum is the request's (see Request.intentSum): whether a finish settles the
	// key's outbox intent.
	intentSum []byte
	xid       string // the id of the transaction that wrote it last (a finish, a DoTx commit)
	taskID    string // the delivery's asynq TaskID (Request.TaskID), for its key's history
	prevFence int64  // a takeover's: the fence of the claim taken over
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

// maxClaimRounds bounds the re-reads after lost races; past it the key is reported busy.
const maxClaimRounds = 5

// Claim tries to take req.Key. On success exactly one of the result's fields is set: a
// new *Claim (run the work, then Complete or Fail it; Do does all of this), or the stored
// Result of a completed key. Otherwise the error is a *BusyError (ErrBusy: another claim
// holds the key, retry when it ends), a *FailedError (ErrFailed), a *MismatchError
// (ErrMismatch), or wraps ErrNeedsAttention, ErrInvalidKey, ErrInvalidRequest,
// ErrUnavailable, a context error or a database error. A claim commits before Claim returns. Safe for concurrent
// use.
func (l *Ledger) Claim(ctx context.Context, req Request) (ClaimResult, error) {
	if err := req.validate(); err != nil {
		return ClaimResult{}, err
	}
	for round := 0; ; round++ {
		c, p, err := l.newClaim(ctx, req)
		if err != nil {
			return ClaimResult{}, err
		}
		op := &leasedOp{key: req.Key, claim: &p, span: trace.SpanFromContext(ctx)}
		err = l.leased.Run(ctx, laneClaim, op)
		if err == nil && !op.answered {
			err = fmt.Errorf("no answer for the key")
		}
		if err != nil {
			return ClaimResult{}, asUnavailable(ctx, l.claimError(req, err))
		}
		r := &op.row
		if !r.Claimed && r.Attempted {
			// Lost a race with a concurrent change: look again with a fresh snapshot (a
			// row deleted meanwhile reads as none, which decide counts as a race).
			if err := store.ReadRow(ctx, l.pool, req.Key, r); err != nil {
				return ClaimResult{}, asUnavailable(ctx, fmt.Errorf("idempotency: claim %s: %w", req.Key, err))
			}
		}
		res, stuck, again, err := l.decide(ctx, req, c, r, round)
		if stuck != 0 {
			l.markStuckOne(ctx, req, stuck)
		}
		if again {
			continue
		}
		return res, err
	}
}

// newClaim makes the identity of a claim attempt and its parameters, with the trace id of
// ctx's span when it is sampled.
func (l *Ledger) newClaim(ctx context.Context, req Request) (*Claim, store.ClaimParams, error) {
	lease := l.leaseFor(req.Deadline)
	if lease <= 0 {
		return nil, store.ClaimParams{}, fmt.Errorf("idempotency: claim %s: the delivery deadline has passed: %w", req.Key, context.DeadlineExceeded)
	}
	owner, err := store.NewOwner()
	if err != nil {
		return nil, store.ClaimParams{}, fmt.Errorf("idempotency: owner id: %w", err)
	}
	c := &Claim{Key: req.Key, TaskType: req.TaskType, deadline: req.Deadline, lease: lease, intentSum: req.intentSum(), owner: owner,
		taskID: req.TaskID}
	c.Owner = formatUUID(c.owner.Bytes)
	c.sentAt = time.Now()
	p := store.ClaimParams{Key: req.Key, TaskType: req.TaskType, Owner: c.owner, Fingerprint: req.Fingerprint, Lease: lease}
	if sc := trace.SpanContextFromContext(ctx); sc.IsSampled() {
		p.TraceID = sc.TraceID().String()
	}
	return c, p, nil
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

// decide turns a claim's row into an outcome. stuck is a fence to mark needs_attention
// (after any transaction ends); again asks for another claim round.
func (l *Ledger) decide(ctx context.Context, req Request, c *Claim, r *store.ClaimRow, round int) (res ClaimResult, stuck int64, again bool, err error) {
	switch v := r.Verdict(req.Fingerprint, l.cfg.MaxAge); {
	case v == store.Claimed:
		c.Fence, c.Attempt, c.Generation = r.Fence.Int64, int(r.Attempts.Int32), int(r.Generation.Int32)
		c.LeaseUntil = r.LockedUntil.Time
		c.prevFence = r.PrevFence.Int64
		if c.Attempt > 1 {
			l.observe(EventTakeover, req.TaskType)
			l.tookOver(ctx, c)
		} else {
			l.observe(EventClaimed, req.TaskType)
		}
		return ClaimResult{Claim: c}, 0, false, nil
	case v == store.Race && round+1 < maxClaimRounds:
		return ClaimResult{}, 0, true, nil
	default:
		res, stuck, err = l.notTaken(req, v, r)
		return res, stuck, false, err
	}
}

func (l *Ledger) tookOver(ctx context.Context, c *Claim) {
	l.log.InfoContext(ctx, "idempotency: took over an expired lease", "task_type", c.TaskType, "key", c.Key, "fence", c.Fence, "attempt", c.Attempt)
	l.recordClaim(HistoryTakeover, c, fmt.Sprintf("attempt %d", c.Attempt))
}

// notTaken is the answer of a claim whose row r, of verdict v, did not take the key: a
// completed key's stored result, or the error that says why (a race past the last round
// is busy). stuck is a fence to mark needs_attention.
func (l *Ledger) notTaken(req Request, v store.Verdict, r *store.ClaimRow) (res ClaimResult, stuck int64, err error) {
	switch v {
	case store.Cached:
		l.observe(EventCacheHit, req.TaskType)
		if !l.cfg.NoDuplicateHistory {
			l.recordRow(HistoryDuplicate, req, r, "")
		}
		return ClaimResult{Completed: &Result{
			Key: req.Key, Result: json.RawMessage(r.Result), Cached: true, Fence: r.Fence.Int64,
			Attempts: int(r.Attempts.Int32), Generation: int(r.Generation.Int32), CompletedAt: r.CompletedAt.Time,
		}}, 0, nil
	case store.Mismatch:
		l.observe(EventMismatch, req.TaskType)
		l.recordRow(HistoryMismatch, req, r, "the key was recorded with another payload's fingerprint")
		return ClaimResult{}, 0, &MismatchError{Key: req.Key}
	case store.Failed:
		l.observe(EventFailedKey, req.TaskType)
		return ClaimResult{}, 0, &FailedError{Key: req.Key, LastError: r.LastError.String}
	case store.NeedsAttention:
		l.observe(EventNeedsAttention, req.TaskType)
		l.recordRow(HistoryNeedsAttention, req, r, "a delivery found the key needs attention")
		return ClaimResult{}, 0, fmt.Errorf("%w: key %q", ErrNeedsAttention, req.Key)
	case store.Stuck:
		l.observe(EventNeedsAttention, req.TaskType)
		l.recordRow(HistoryNeedsAttention, req, r, fmt.Sprintf("in progress since %s, longer than the maximum age %s: marked",
			r.StartedAt.Time.UTC().Format(time.RFC3339), l.cfg.MaxAge))
		return ClaimResult{}, r.Fence.Int64, fmt.Errorf("%w: key %q in progress since %s, longer than the maximum age %s",
			ErrNeedsAttention, req.Key, r.StartedAt.Time.UTC().Format(time.RFC3339), l.cfg.MaxAge)
	}
	l.observe(EventBusy, req.TaskType)
	busy := &BusyError{Key: req.Key}
	if v == store.Busy && r.Status.String == StatusInProgress {
		busy.Owner, busy.Fence, busy.Until = formatUUID(r.Owner.Bytes), r.Fence.Int64, r.LockedUntil.Time
		busy.Age = max(r.DBNow.Sub(r.StartedAt.Time), time.Nanosecond)
		busy.Generation = int(r.Generation.Int32)
	}
	return ClaimResult{}, 0, busy
}

// recordRow records kind for req's key, whose row the claim read as r.
func (l *Ledger) recordRow(kind HistoryKind, req Request, r *store.ClaimRow, detail string) {
	l.Record(HistoryEvent{Key: req.Key, Generation: int(r.Generation.Int32), Kind: kind, TaskType: req.TaskType, TaskID: req.TaskID,
		Fence: r.Fence.Int64, Detail: detail})
}

func (l *Ledger) markStuckOne(ctx context.Context, req Request, fence int64) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
	defer cancel()
	if err := store.MarkStuckOne(ctx, l.pool, req.Key, fence); err != nil {
		l.log.WarnContext(ctx, "idempotency: mark needs_attention", "task_type", req.TaskType, "key", req.Key, "fence", fence, "err", err)
		return
	}
	l.log.WarnContext(ctx, "idempotency: in progress past the maximum age; needs attention", "task_type", req.TaskType, "key", req.Key, "fence", fence)
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
