package store

import (
	"context"
	"strconv"
	"text/template"
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

// FindSQL is the console's list under p's filters, with its arguments (find.sql).
func FindSQL(p FindParams) (string, []any) {
	q := &findQuery{FindParams: p}
	return render(findTemplate, q), q.args
}

// findQuery fills find.sql: FindParams' filters, and Arg, which takes each value as the
// statement's next parameter.
type findQuery struct {
	FindParams
	args []any
}

// Arg adds v to the arguments and returns its parameter ($1, $2, ...).
func (q *findQuery) Arg(v any) string {
	q.args = append(q.args, v)
	return "$" + strconv.Itoa(len(q.args))
}

// Live and Lapsed are the lease filters.
func (q *findQuery) Live() bool   { return q.Lease == LeaseLive }
func (q *findQuery) Lapsed() bool { return q.Lease == LeaseLapsed }

// findTemplate is find.sql, rendered once at init with every filter set, to check it.
var findTemplate = func() *template.Template {
	t := sqlTemplate("find")
	all := FindParams{Status: "s", TaskType: "t", StartedWithin: 1, StartedBefore: 1, HasDuplicates: true, Limit: 1}
	for _, lease := range []string{LeaseLive, LeaseLapsed} {
		all.Lease = lease
		render(t, &findQuery{FindParams: all})
	}
	return t
}()

// CountsSQL counts, over a window, the rows started in it by status and lease and the
// events recorded in it by kind (counts.sql).
var CountsSQL = sqlText("counts", nil)

// intentTasksSQL reads the queues and publish generations of intents (intent_tasks.sql).
var intentTasksSQL = sqlText("intent_tasks", nil)

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
