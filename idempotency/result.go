package idempotency

import (
	"context"
	"encoding/json"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemq/idemq/idempotency/internal/store"
)

// Result is what a completed key returned.
type Result struct {
	Key string
	// Result is the stored JSON (nil when the work returned none): the handler's own bytes
	// on the run that completed the key, jsonb's normalised text (same value, other
	// spacing) when Cached. When the work's result could not be stored, it is an error
	// marker: {"idemq_error":"..."}.
	Result json.RawMessage
	// Cached is true when the result was stored by an earlier run, not this call's.
	Cached bool
	// Fence is the fence of the claim that completed the key (this call's claim when not
	// Cached; the one that ran when Cached).
	Fence int64
	// Attempts counts the claims of the key.
	Attempts int
	// Generation is the generation that completed.
	Generation int
	// CompletedAt is when the stored result's completion committed, by the database
	// clock; set only when Cached.
	CompletedAt time.Time
}

// maxLastErrorBytes caps last_error.
const maxLastErrorBytes = store.MaxTextBytes

// ValidateResult reports why result cannot be stored in a jsonb column within maxBytes:
// too large, not valid UTF-8 JSON, or holding an escape jsonb refuses (\u0000, an
// unpaired surrogate). An empty result is valid (stored as NULL).
func ValidateResult(result json.RawMessage, maxBytes int) error {
	return store.ValidateResult(result, maxBytes)
}

// checkResult returns what to store for result and the last_error to record (not
// valid: none).
func (l *Ledger) checkResult(ctx context.Context, c *Claim, result json.RawMessage) (stored, lastErr pgtype.Text) {
	stored, lastErr = store.ResultText(result, l.cfg.MaxResultBytes)
	if lastErr.Valid {
		l.observe(EventBadResult, c.TaskType)
		l.badResult(ctx, c, lastErr.String)
	}
	return stored, lastErr
}

// completed is the Result of c's completion with out, whose checkResult verdict is
// stored and lastErr: the handler's own bytes, or the error marker stored instead of a
// result that cannot be stored.
func (c *Claim) completed(out json.RawMessage, stored, lastErr pgtype.Text) Result {
	r := Result{Key: c.Key, Fence: c.Fence, Attempts: c.Attempt, Generation: c.Generation}
	switch {
	case lastErr.Valid:
		r.Result = json.RawMessage(stored.String)
	case len(out) > 0:
		r.Result = out
	}
	return r
}

// markResult builds the error marker stored instead of a result that cannot be stored.
func (l *Ledger) markResult(ctx context.Context, c *Claim, msg string) (stored, lastErr pgtype.Text) {
	stored, lastErr = store.MarkerText(msg)
	l.observe(EventBadResult, c.TaskType)
	l.badResult(ctx, c, lastErr.String)
	return stored, lastErr
}

// badResult logs a result replaced by an error marker.
func (l *Ledger) badResult(ctx context.Context, c *Claim, msg string) {
	l.log.ErrorContext(ctx, "idempotency: result replaced by an error marker; the key completes", "task_type", c.TaskType, "key", c.Key, "fence", c.Fence, "err", msg)
}

// cleanText makes s storable as last_error (see store.CleanText).
func cleanText(s string) string { return store.CleanText(s) }
