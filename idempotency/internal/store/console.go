package store

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// The operators' console: the ledger list under filters, and counts per outcome and per
// event kind over a window. Every time is compared with now(), the database clock.

// Lease states a filter selects among in-progress rows.
const (
	LeaseLive   = "live"   // locked_until > now(): a worker holds the key
	LeaseLapsed = "lapsed" // locked_until <= now() or NULL: the next delivery takes it over
)

// FindParams are the filters of FindSQL; a zero field does not filter.
type FindParams struct {
	Status        string
	TaskType      string
	StartedWithin time.Duration // started_at >= now() - StartedWithin
	StartedBefore time.Duration // started_at < now() - StartedBefore (older than)
	Lease         string        // LeaseLive or LeaseLapsed (in-progress rows only)
	HasDuplicates bool          // a 'duplicate' event exists for the key
	Limit         int           // > 0
}

// FindSQL is the console's list: the newest rows by started_at (its index serves the order
// and the age filters, so LIMIT ends the scan early), under p's filters. Only the filters
// that are set are in the statement, so each combination is planned for what it asks.
func FindSQL(p FindParams) (string, []any) {
	var (
		where []string
		args  []any
	)
	arg := func(v any) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args))
	}
	if p.Status != "" {
		where = append(where, "status = "+arg(p.Status))
	}
	if p.TaskType != "" {
		where = append(where, "task_type = "+arg(p.TaskType))
	}
	if p.StartedWithin > 0 {
		where = append(where, "started_at >= now() - make_interval(secs => "+arg(p.StartedWithin.Seconds())+")")
	}
	if p.StartedBefore > 0 {
		where = append(where, "started_at < now() - make_interval(secs => "+arg(p.StartedBefore.Seconds())+")")
	}
	switch p.Lease {
	case LeaseLive:
		where = append(where, "status = 'in_progress' AND locked_until > now()")
	case LeaseLapsed:
		where = append(where, "status = 'in_progress' AND (locked_until IS NULL OR locked_until <= now())")
	}
	if p.HasDuplicates {
		where = append(where, `EXISTS (SELECT FROM processed_job_events e
	WHERE e.idempotency_key = processed_jobs.idempotency_key AND e.kind = 'duplicate')`)
	}
	sql := "SELECT " + RecordColumns + " FROM processed_jobs"
	if len(where) > 0 {
		sql += "\nWHERE " + strings.Join(where, "\n  AND ")
	}
	sql += "\nORDER BY started_at DESC, idempotency_key LIMIT " + arg(p.Limit)
	return sql, args
}

// CountsSQL counts, over the window of $1 seconds, the rows started in it by status and
// lease (live: in progress with locked_until > now()), through the started_at index, and
// the events recorded in it by kind, through the at index. Rows: ('row', status, live, n)
// and ('event', kind, false, n).
const CountsSQL = `
SELECT 'row', status, coalesce(status = 'in_progress' AND locked_until > now(), false), count(*)
FROM processed_jobs WHERE started_at >= now() - make_interval(secs => $1)
GROUP BY 2, 3
UNION ALL
SELECT 'event', kind, false, count(*)
FROM processed_job_events WHERE at >= now() - make_interval(secs => $1)
GROUP BY 2`

const intentTasksSQL = `SELECT idempotency_key, queue, publish_generation FROM job_intents WHERE idempotency_key = ANY($1)`

// IntentTask is where an intent's tasks are: its queue and its current publish generation.
type IntentTask struct {
	Queue             string
	PublishGeneration int
}

// IntentTasks returns the queue and publish generation of each of keys' intents, by key;
// keys without an intent are absent.
func IntentTasks(ctx context.Context, q DB, keys []string) (map[string]IntentTask, error) {
	out := make(map[string]IntentTask, len(keys))
	if len(keys) == 0 {
		return out, nil
	}
	rows, err := q.Query(ctx, intentTasksSQL, keys)
	if err != nil {
		return out, err
	}
	var (
		key string
		it  IntentTask
	)
	_, err = pgx.ForEachRow(rows, []any{&key, &it.Queue, &it.PublishGeneration}, func() error {
		out[key] = it
		return nil
	})
	return out, err
}
