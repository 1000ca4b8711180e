package store

import (
	"context"

	"github.com/jackc/pgx/v5/pgconn"
)

// settleIntentSQL settles key $1's outbox intent for a delivery of its own task whose
// answer came from the ledger without a finish of its own: 'done' ($4) for a cached
// result, 'dead' with the reason $5 for a mismatch, a failed or stuck row or a payload the
// worker refused. $2 is the task type and $3 the fingerprint of the task's type and
// payload bytes, which for the intent's own task is the intent's (see
// FinishParams.IntentSum).
const settleIntentSQL = `
UPDATE job_intents
SET state = $4, last_error = CASE WHEN $4 = 'dead' THEN $5 ELSE last_error END,
    finished_at = now(), updated_at = now()
WHERE idempotency_key = $1 AND task_type = $2 AND payload_sha256 = $3 AND state IN ('pending', 'published')`

// Intent states a settle writes.
const (
	IntentDone = "done"
	IntentDead = "dead"
)

// SettleIntent settles key's intent as state (IntentDone or IntentDead, with reason) when
// it is still pending or published and sum is its payload's; it reports whether it did.
func SettleIntent(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, key, taskType string, sum []byte, state, reason string) (bool, error) {
	tag, err := q.Exec(ctx, settleIntentSQL, key, taskType, sum, state, reason)
	return tag.RowsAffected() > 0, err
}
