package store

import (
	"context"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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

// insertIntentsSQL records many intents in one statement, in the order given (key order,
// so that concurrent batches lock their rows in one order), held from the relays for $10
// ms when $10 > 0.
const insertIntentsSQL = `
INSERT INTO job_intents (idempotency_key, task_type, payload, payload_sha256, queue, max_retry, timeout_ms, retention_ms, trace_parent, relay_until)
SELECT u.k, u.t, u.p, u.f, u.q, u.m, u.o, u.r, nullif(u.tp, ''), CASE WHEN $10::bigint > 0 THEN now() + $10::bigint * interval '1 millisecond' END
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[], $5::text[], $6::int[], $7::bigint[], $8::bigint[], $9::text[]) AS u(k, t, p, f, q, m, o, r, tp)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING idempotency_key, state`

// InsertIntents records the intents of ps (in their order: give them in key order) that
// are not recorded yet, held from the relays for hold when it is positive, and returns
// the state of each it recorded, by key.
func InsertIntents(ctx context.Context, q DB, ps []IntentParams, hold time.Duration) (map[string]string, error) {
	n := len(ps)
	keys, types, queues := make([]string, n), make([]string, n), make([]string, n)
	payloads, fps, traces := make([][]byte, n), make([][]byte, n), make([]string, n)
	maxRetry, timeouts, retentions := make([]int32, n), make([]int64, n), make([]int64, n)
	for i, p := range ps {
		keys[i], types[i], queues[i], payloads[i], fps[i], traces[i] = p.Key, p.TaskType, p.Queue, p.Payload, p.Fingerprint, p.TraceParent
		maxRetry[i], timeouts[i], retentions[i] = int32(p.MaxRetry), p.Timeout.Milliseconds(), p.Retention.Milliseconds()
	}
	rows, err := q.Query(ctx, insertIntentsSQL, keys, types, payloads, fps, queues, maxRetry, timeouts, retentions, traces, hold.Milliseconds())
	if err != nil {
		return nil, err
	}
	inserted := make(map[string]string, n)
	var key, state string
	_, err = pgx.ForEachRow(rows, []any{&key, &state}, func() error {
		inserted[key] = state
		return nil
	})
	return inserted, err
}

// RecordedIntent is what an intent recorded before holds of a new one's identity.
type RecordedIntent struct {
	TaskType    string
	Fingerprint []byte
	State       string
}

const readIntentsSQL = `SELECT idempotency_key, task_type, payload_sha256, state FROM job_intents WHERE idempotency_key = ANY($1::text[])`

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

// intentRowColumns are the columns of an IntentRow, as scanIntentRow reads them.
const intentRowColumns = `idempotency_key, task_type, payload, queue, max_retry, timeout_ms, retention_ms, publish_generation, created_at, `

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

// takePendingSQL takes up to $1 pending intents (only keys in $3 when it is not NULL) for
// $2 ms in one short statement: SKIP LOCKED lets every replica's relay run at once.
const takePendingSQL = `
UPDATE job_intents SET relay_until = now() + $2::bigint * interval '1 millisecond', updated_at = now()
WHERE idempotency_key IN (
	SELECT idempotency_key FROM job_intents
	WHERE state = 'pending' AND (relay_until IS NULL OR relay_until < now())
	  AND ($3::text[] IS NULL OR idempotency_key = ANY($3::text[]))
	ORDER BY created_at
	LIMIT $1
	FOR UPDATE SKIP LOCKED)
RETURNING ` + intentRowColumns + `coalesce(published_at, created_at),
	coalesce(trace_parent, '')`

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

// markPublishedSQL records the publishes of keys $1, each under the generation at the same
// index of $2, of intents still pending under the generation they were taken under ($3):
// an intent an operator re-ran meanwhile (a new publish generation) waits for a publish
// of its own.
//
// It and markPublishFailedSQL find their rows by key only: "state IS NOT DISTINCT FROM
// 'pending'" keeps the planner off job_intents_pending_idx, which statistics make look
// small while, under load, it holds the entries of every intent published since the last
// vacuum, and which it would otherwise scan whole on every call.
const markPublishedSQL = `
UPDATE job_intents i
SET state = 'published', published_at = now(), publish_generation = p.gen, relay_until = NULL, last_error = NULL, updated_at = now()
FROM unnest($1::text[], $2::int[], $3::int[]) AS p(key, gen, taken)
WHERE i.idempotency_key = p.key AND i.state IS NOT DISTINCT FROM 'pending' AND i.publish_generation = p.taken`

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

const markPublishFailedSQL = `
UPDATE job_intents SET relay_until = now() + $2::bigint * interval '1 millisecond', last_error = $3, updated_at = now()
WHERE idempotency_key = ANY($1::text[]) AND state IS NOT DISTINCT FROM 'pending'`

// MarkPublishFailed records reason as the last error of the intents of keys still
// pending, and holds them from the relays for retryIn.
func MarkPublishFailed(ctx context.Context, q DB, keys []string, retryIn time.Duration, reason string) error {
	_, err := q.Exec(ctx, markPublishFailedSQL, PlanEach, keys, retryIn.Milliseconds(), reason)
	return err
}

// cutoffSQL is the publish time before which a round with grace $1 ms checks intents, on
// the database clock.
const cutoffSQL = `SELECT now() - $1::bigint * interval '1 millisecond'`

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

// staleIntentsSQL lists up to $4 intents published before $1, after the cursor
// (published_at, key) = ($2, $3), in that order; only in the queues $5 unless it is NULL.
const staleIntentsSQL = `
SELECT ` + intentRowColumns + `published_at,
       coalesce(trace_parent, '')
FROM job_intents
WHERE state = 'published' AND published_at < $1 AND (published_at, idempotency_key) > ($2, $3)
  AND ($5::text[] IS NULL OR queue = ANY($5::text[]))
ORDER BY published_at, idempotency_key
LIMIT $4`

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

// bumpGenerationSQL records a republish under generation $3, unless another reconciler
// did it first, and a republished event in the key's history (worker $4), within
// MaxEventsPerGeneration of the ledger row's generation (0 while the key has no row).
const bumpGenerationSQL = `
WITH u AS (
	UPDATE job_intents SET publish_generation = $3, published_at = now(), updated_at = now()
	WHERE idempotency_key = $1 AND state = 'published' AND publish_generation = $2
	RETURNING idempotency_key, task_type
), g AS (
	SELECT coalesce((SELECT generation FROM processed_jobs WHERE idempotency_key = $1), 0) AS gen
), h AS (
	INSERT INTO processed_job_events (idempotency_key, generation, kind, task_type, task_id, worker, detail)
	SELECT u.idempotency_key, g.gen, 'republished', u.task_type, $1 || '#r' || $3::int, $4,
	       'its task was missing from Redis; republished'
	FROM u, g
	WHERE (SELECT count(*) FROM processed_job_events x WHERE x.idempotency_key = $1 AND x.generation = g.gen) < 50
)
SELECT count(*) FROM u`

// RecordRepublish records that key's published intent, of generation from, was
// republished under generation to, with an event in the key's history; it reports false
// when another reconciler did it first or the intent finished meanwhile.
func RecordRepublish(ctx context.Context, q DB, key string, from, to int) (bool, error) {
	var n int64
	err := q.QueryRow(ctx, bumpGenerationSQL, key, from, to, Worker).Scan(&n)
	return n > 0, err
}

// settleArchivedSQL settles dead, with the reason $3, a published intent whose own task
// asynq archived (its retries ran out, or the worker refused it without settling the
// intent itself), unless another reconciler or a delivery settled or republished it first.
const settleArchivedSQL = `
UPDATE job_intents SET state = 'dead', last_error = $3, finished_at = now(), updated_at = now()
WHERE idempotency_key = $1 AND state = 'published' AND publish_generation = $2`

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

// intentInfoColumns are an IntentInfo's columns but the trace parent.
const intentInfoColumns = `idempotency_key, task_type, state, publish_generation, coalesce(last_error, ''),
	created_at, coalesce(published_at, 'epoch'), coalesce(finished_at, 'epoch')`

func (i *IntentInfo) zeroEpochs() {
	for _, t := range []*time.Time{&i.PublishedAt, &i.FinishedAt} {
		if t.Unix() == 0 {
			*t = time.Time{}
		}
	}
}

const intentInfoSQL = `SELECT ` + intentInfoColumns + `, coalesce(trace_parent, '')
	FROM job_intents WHERE idempotency_key = $1`

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

const unfinishedIntentsSQL = `SELECT ` + intentInfoColumns + `
	FROM job_intents WHERE state IN ('pending', 'published') ORDER BY created_at LIMIT $1`

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

// intentQueuesSQL reads the queues the outbox recorded for keys.
const intentQueuesSQL = `SELECT idempotency_key, queue FROM job_intents WHERE idempotency_key = ANY($1)`

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

const outboxStatsSQL = `
SELECT count(*) FILTER (WHERE state = 'pending'),
       coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE state = 'pending')), 0)::float8,
       count(*) FILTER (WHERE state = 'published'),
       coalesce(extract(epoch FROM now() - min(published_at) FILTER (WHERE state = 'published')), 0)::float8,
       count(*) FILTER (WHERE state = 'published' AND published_at < now() - $1::bigint * interval '1 millisecond')
FROM job_intents WHERE state IN ('pending', 'published')`

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

// Notify sends a notification with an empty payload on channel: to its listeners when
// q's transaction commits, at once when q is not in one.
func Notify(ctx context.Context, q DB, channel string) error {
	_, err := q.Exec(ctx, `SELECT pg_notify($1, '')`, channel)
	return err
}
