package store

import (
	"context"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// The outbox's statements on job_intents: recording intents, the relays' takes and
// publishes, the reconciler's republishes, and the reads of operators and the API.

// DB is what a statement runs on: a pool, a connection or a transaction.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// PlanEach, as a statement's first argument, has Postgres plan the statement for its
// arguments each time (an unnamed statement) instead of reusing a generic plan: a generic
// plan made while job_intents was small (a new deployment, an emptied table) scans the
// whole table for a few keys until the next ANALYZE, which under load comes minutes later.
const PlanEach = pgx.QueryExecModeCacheDescribe

// settleIntentSQL settles a key's outbox intent for a delivery of its own task whose
// answer came from the ledger without a finish of its own (settle_intent.sql).
var settleIntentSQL = sqlText("settle_intent", nil)

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

// IntentParams is one intent to record.
type IntentParams struct {
	Key, TaskType      string
	Payload            []byte
	Fingerprint        []byte // of the task type and payload (idempotency.Fingerprint)
	Queue              string
	MaxRetry           int
	Timeout, Retention time.Duration // stored in milliseconds
	TraceParent        string        // "" is stored as NULL
}

// insertIntentsSQL records many intents in one statement, in the order given
// (insert_intents.sql).
var insertIntentsSQL = sqlText("insert_intents", nil)

// InsertIntents records the intents of ps (in their order: give them in key order) that
// are not recorded yet, held from the relays for hold when it is positive, and returns
// the state of each it recorded, by key.
func InsertIntents(ctx context.Context, q DB, ps []IntentParams, hold time.Duration) (map[string]string, error) {
	rows, err := q.Query(ctx, insertIntentsSQL, append(intentArgs(ps), hold.Milliseconds())...)
	if err != nil {
		return nil, err
	}
	inserted := make(map[string]string, len(ps))
	var key, state string
	_, err = pgx.ForEachRow(rows, []any{&key, &state}, func() error {
		inserted[key] = state
		return nil
	})
	return inserted, err
}

// intentOIDs are intentArgs' parameter types.
var intentOIDs = []uint32{pgtype.TextArrayOID, pgtype.TextArrayOID, pgtype.ByteaArrayOID, pgtype.ByteaArrayOID,
	pgtype.TextArrayOID, pgtype.Int4ArrayOID, pgtype.Int8ArrayOID, pgtype.Int8ArrayOID, pgtype.TextArrayOID}

// intentArgs are insert_intents.sql's arrays ($1..$9) for ps, of the types intentOIDs.
func intentArgs(ps []IntentParams) []any {
	n := len(ps)
	keys, types, queues := make([]string, n), make([]string, n), make([]string, n)
	payloads, fps, traces := make([][]byte, n), make([][]byte, n), make([]string, n)
	maxRetry, timeouts, retentions := make([]int32, n), make([]int64, n), make([]int64, n)
	for i, p := range ps {
		keys[i], types[i], queues[i], payloads[i], fps[i], traces[i] = p.Key, p.TaskType, p.Queue, p.Payload, p.Fingerprint, p.TraceParent
		maxRetry[i], timeouts[i], retentions[i] = int32(p.MaxRetry), p.Timeout.Milliseconds(), p.Retention.Milliseconds()
	}
	return []any{keys, types, payloads, fps, queues, maxRetry, timeouts, retentions, traces}
}

// RecordedIntent is what an intent recorded before holds of a new one's identity.
type RecordedIntent struct {
	TaskType    string
	Fingerprint []byte
	State       string
}

// readIntentsSQL reads the recorded intents of keys (read_intents.sql).
var readIntentsSQL = sqlText("read_intents", nil)

// ReadIntents returns the recorded intents of keys, by key (planned for its keys each
// time: PlanEach).
func ReadIntents(ctx context.Context, q DB, keys []string) (map[string]RecordedIntent, error) {
	rows, err := q.Query(ctx, readIntentsSQL, PlanEach, keys)
	if err != nil {
		return nil, err
	}
	known := make(map[string]RecordedIntent, len(keys))
	var key string
	var r RecordedIntent
	_, err = pgx.ForEachRow(rows, []any{&key, &r.TaskType, &r.Fingerprint, &r.State}, func() error {
		known[key] = RecordedIntent{r.TaskType, slices.Clone(r.Fingerprint), r.State}
		return nil
	})
	return known, err
}

// IntentRow is an intent taken for publishing, or republishing.
type IntentRow struct {
	Key, TaskType      string
	Payload            []byte
	Queue              string
	MaxRetry           int
	Timeout, Retention time.Duration
	Generation         int // its publish generation
	CreatedAt          time.Time
	PublishedAt        time.Time // its last publish; CreatedAt while pending
	TraceParent        string
}

// scanIntentRow reads the columns takePendingSQL and staleIntentsSQL return.
func scanIntentRow(row pgx.CollectableRow) (IntentRow, error) {
	var r IntentRow
	var timeout, retention int64
	err := row.Scan(&r.Key, &r.TaskType, &r.Payload, &r.Queue, &r.MaxRetry,
		&timeout, &retention, &r.Generation, &r.CreatedAt, &r.PublishedAt, &r.TraceParent)
	r.Timeout, r.Retention = time.Duration(timeout)*time.Millisecond, time.Duration(retention)*time.Millisecond
	return r, err
}

// TakeParams says which pending intents a relay round takes.
type TakeParams struct {
	Limit int           // at most this many, oldest first
	Hold  time.Duration // from the other relays, for this long
	Keys  []string      // only these keys; nil: any
}

// takePendingSQL takes pending intents for a while, skipping those other relays hold
// (take_pending.sql).
var takePendingSQL = sqlText("take_pending", nil)

// TakePending takes the pending intents p asks for, that no other relay holds.
func TakePending(ctx context.Context, q DB, p TakeParams) ([]IntentRow, error) {
	var only any
	if p.Keys != nil {
		only = p.Keys
	}
	rows, err := q.Query(ctx, takePendingSQL, PlanEach, p.Limit, p.Hold.Milliseconds(), only)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, scanIntentRow)
}

// Publish is one intent published: its key, the publish generation it was taken under
// and the generation it went out under (a publish moves past TaskIDs that other tasks
// hold).
type Publish struct {
	Key        string
	Taken      int
	Generation int
}

// markPublishedSQL records publishes of intents still pending under the generation
// they were taken under (mark_published.sql).
var markPublishedSQL = sqlText("mark_published", nil)

// MarkPublished records ps's publishes of intents still pending under the generation
// they were taken under.
func MarkPublished(ctx context.Context, q DB, ps []Publish) error {
	keys, gens, taken := make([]string, len(ps)), make([]int32, len(ps)), make([]int32, len(ps))
	for i, p := range ps {
		keys[i], gens[i], taken[i] = p.Key, int32(p.Generation), int32(p.Taken)
	}
	_, err := q.Exec(ctx, markPublishedSQL, PlanEach, keys, gens, taken)
	return err
}

// markPublishFailedSQL records a failed publish of pending intents
// (mark_publish_failed.sql).
var markPublishFailedSQL = sqlText("mark_publish_failed", nil)

// MarkPublishFailed records reason as the last error of the intents of keys still
// pending, and holds them from the relays for retryIn.
func MarkPublishFailed(ctx context.Context, q DB, keys []string, retryIn time.Duration, reason string) error {
	_, err := q.Exec(ctx, markPublishFailedSQL, PlanEach, keys, retryIn.Milliseconds(), reason)
	return err
}

// cutoffSQL is the publish time before which a round checks intents, on the database
// clock (cutoff.sql).
var cutoffSQL = sqlText("cutoff", nil)

// Cutoff is grace ago, on the database clock.
func Cutoff(ctx context.Context, q DB, grace time.Duration) (time.Time, error) {
	var t time.Time
	err := q.QueryRow(ctx, cutoffSQL, grace.Milliseconds()).Scan(&t)
	return t, err
}

// StaleParams says which page of published intents a reconcile round reads.
type StaleParams struct {
	Before   time.Time // published before this
	AfterAt  time.Time // after the cursor (AfterAt, AfterKey), in that order
	AfterKey string
	Limit    int
	Queues   []string // only in these queues; nil: in any
}

// staleIntentsSQL lists a page of intents published before a time, after a cursor
// (stale_intents.sql).
var staleIntentsSQL = sqlText("stale_intents", nil)

// StaleIntents returns the page of published intents p asks for.
func StaleIntents(ctx context.Context, q DB, p StaleParams) ([]IntentRow, error) {
	var only any
	if p.Queues != nil {
		only = p.Queues
	}
	rows, err := q.Query(ctx, staleIntentsSQL, p.Before, p.AfterAt, p.AfterKey, p.Limit, only)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, scanIntentRow)
}

// bumpGenerationSQL records a republish, unless another reconciler did it first, and a
// republished event in the key's history (bump_generation.sql).
var bumpGenerationSQL = sqlText("bump_generation", nil)

// RecordRepublish records that key's published intent, of generation from, was
// republished under generation to, with an event in the key's history; it reports false
// when another reconciler did it first or the intent finished meanwhile.
func RecordRepublish(ctx context.Context, q DB, key string, from, to int) (bool, error) {
	var n int64
	err := q.QueryRow(ctx, bumpGenerationSQL, key, from, to, Worker).Scan(&n)
	return n > 0, err
}

// settleArchivedSQL settles dead a published intent whose own task asynq archived
// (settle_archived.sql).
var settleArchivedSQL = sqlText("settle_archived", nil)

// SettleArchived settles dead, with reason, key's intent still published under
// generation gen; it reports whether it did.
func SettleArchived(ctx context.Context, q DB, key string, gen int, reason string) (bool, error) {
	tag, err := q.Exec(ctx, settleArchivedSQL, key, gen, reason)
	return tag.RowsAffected() > 0, err
}

// IntentInfo is an intent's row, for operators and the API. Its fields are those of
// outbox.IntentInfo, in the same order (the outbox converts one to the other).
type IntentInfo struct {
	Key               string
	TaskType          string
	State             string
	PublishGeneration int
	LastError         string
	CreatedAt         time.Time
	PublishedAt       time.Time // zero: never published
	FinishedAt        time.Time // zero: not finished
	TraceParent       string
}

func (i *IntentInfo) zeroEpochs() {
	for _, t := range []*time.Time{&i.PublishedAt, &i.FinishedAt} {
		if t.Unix() == 0 {
			*t = time.Time{}
		}
	}
}

// intentInfoSQL reads a key's intent (intent_info.sql).
var intentInfoSQL = sqlText("intent_info", nil)

// ReadIntent returns key's intent; pgx.ErrNoRows when it has none.
func ReadIntent(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, key string) (IntentInfo, error) {
	var i IntentInfo
	err := q.QueryRow(ctx, intentInfoSQL, key).Scan(&i.Key, &i.TaskType, &i.State, &i.PublishGeneration,
		&i.LastError, &i.CreatedAt, &i.PublishedAt, &i.FinishedAt, &i.TraceParent)
	i.zeroEpochs()
	return i, err
}

// unfinishedIntentsSQL reads the oldest unfinished intents (unfinished_intents.sql).
var unfinishedIntentsSQL = sqlText("unfinished_intents", nil)

// UnfinishedIntents returns up to limit intents still pending or published, oldest first
// (without their trace parents).
func UnfinishedIntents(ctx context.Context, q DB, limit int) ([]IntentInfo, error) {
	rows, err := q.Query(ctx, unfinishedIntentsSQL, limit)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (IntentInfo, error) {
		var i IntentInfo
		err := row.Scan(&i.Key, &i.TaskType, &i.State, &i.PublishGeneration, &i.LastError, &i.CreatedAt, &i.PublishedAt, &i.FinishedAt)
		i.zeroEpochs()
		return i, err
	})
}

// intentQueuesSQL reads the queues the outbox recorded for keys (intent_queues.sql).
var intentQueuesSQL = sqlText("intent_queues", nil)

// IntentQueues returns the queue of each of keys' intents, by key; keys without an intent
// are absent.
func IntentQueues(ctx context.Context, q DB, keys []string) (map[string]string, error) {
	queues := make(map[string]string, len(keys))
	if len(keys) == 0 {
		return queues, nil
	}
	rows, err := q.Query(ctx, intentQueuesSQL, keys)
	if err != nil {
		return queues, err
	}
	var key, queue string
	_, err = pgx.ForEachRow(rows, []any{&key, &queue}, func() error {
		queues[key] = queue
		return nil
	})
	return queues, err
}

// OutboxStats is the outbox's backlog.
type OutboxStats struct {
	Pending, Published             int
	OldestPending, OldestPublished time.Duration
	PublishedOlderThan             int
}

// outboxStatsSQL reads the outbox's backlog (outbox_stats.sql).
var outboxStatsSQL = sqlText("outbox_stats", nil)

// ReadOutboxStats returns the outbox's backlog, with the intents published longer than
// threshold ago counted in PublishedOlderThan.
func ReadOutboxStats(ctx context.Context, q DB, threshold time.Duration) (OutboxStats, error) {
	var s OutboxStats
	var oldestPending, oldestPublished float64
	err := q.QueryRow(ctx, outboxStatsSQL, threshold.Milliseconds()).Scan(&s.Pending, &oldestPending, &s.Published, &oldestPublished, &s.PublishedOlderThan)
	s.OldestPending = time.Duration(oldestPending * float64(time.Second))
	s.OldestPublished = time.Duration(oldestPublished * float64(time.Second))
	return s, err
}

// notifySQL notifies a channel (notify.sql).
var notifySQL = sqlText("notify", nil)

// Notify sends a notification with an empty payload on channel: to its listeners when
// q's transaction commits, at once when q is not in one.
func Notify(ctx context.Context, q DB, channel string) error {
	_, err := q.Exec(ctx, notifySQL, channel)
	return err
}
