package idempotency_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// RunRetention purges at once the rows older than the window, keeps the others, and
// runs no round whose turn it does not get.
func TestRunRetentionPurgesOnItsTurn(t *testing.T) {
	t.Parallel()
	l, pool := newLedger(t, nil)
	ctx := testenv.Context(t, 30*time.Second)
	mustExec(t, pool, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, started_at, completed_at)
		VALUES ('old', 'test:task', 'completed', nextval('processed_jobs_fence_seq'), now() - interval '3 days', now() - interval '2 days'),
		       ('new', 'test:task', 'completed', nextval('processed_jobs_fence_seq'), now(), now())`)

	var asked atomic.Int64
	refused, stop := context.WithCancel(ctx)
	go func() {
		time.Sleep(300 * time.Millisecond)
		stop()
	}()
	l.RunRetention(refused, idempotency.RetentionConfig{OlderThan: 24 * time.Hour, Turn: func(context.Context) bool {
		asked.Add(1)
		return false
	}})
	if asked.Load() == 0 || count(t, pool, `SELECT count(*) FROM processed_jobs`) != 2 {
		t.Fatalf("turn asked %d times, %d rows left; want the turn asked and nothing purged", asked.Load(), count(t, pool, `SELECT count(*) FROM processed_jobs`))
	}

	granted, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- l.RunRetention(granted, idempotency.RetentionConfig{OlderThan: 24 * time.Hour}) }()
	for count(t, pool, `SELECT count(*) FROM processed_jobs WHERE idempotency_key = 'old'`) != 0 && ctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if count(t, pool, `SELECT count(*) FROM processed_jobs WHERE idempotency_key = 'new'`) != 1 {
		t.Fatal("a row inside the window was purged")
	}
	if ctx.Err() != nil {
		t.Fatal("the expired row was not purged")
	}
}

// Purge removes dead intents whose key has no ledger row (a payload the decoder refused,
// say) by the same window as rows, in bounded batches, and keeps a
// dead intent inside the window, one whose key has a row not purged, and live intents.
// It works without the index migration 00112 adds, as on the previous schema.
func TestPurgeRemovesDeadIntentsWithoutARow(t *testing.T) {
	t.Parallel()
	for _, withIndex := range []bool{true, false} {
		var mu sync.Mutex
		purged, statements := map[string]int64{}, map[string]int{}
		l, pool := newLedger(t, &idempotency.Config{ObservePurge: func(table string, rows int64, took time.Duration) {
			mu.Lock()
			defer mu.Unlock()
			purged[table] += rows
			statements[table]++
		}})
		ctx := testenv.Context(t, 30*time.Second)
		if !withIndex {
			mustExec(t, pool, `DROP INDEX IF EXISTS job_intents_dead_idx`)
		}
		mustExec(t, pool, `INSERT INTO job_intents (idempotency_key, task_type, payload, payload_sha256, queue, max_retry,
				timeout_ms, retention_ms, state, published_at, finished_at, last_error)
			SELECT k, 't', '\x00', sha256('\x00'), 'default', 0, 0, 0, s, now() - interval '3 days', f, 'invalid payload'
			FROM (VALUES ('dead-old-1', 'dead', now() - interval '2 days'), ('dead-old-2', 'dead', now() - interval '2 days'),
			             ('dead-old-3', 'dead', now() - interval '2 days'),
			             ('dead-new', 'dead', now()), ('dead-with-row', 'dead', now() - interval '2 days'),
			             ('published-old', 'published', NULL)) AS v(k, s, f)`)
		mustExec(t, pool, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, started_at)
			VALUES ('dead-with-row', 't', 'needs_attention', nextval('processed_jobs_fence_seq'), now() - interval '3 days')`)
		mustExec(t, pool, `INSERT INTO processed_job_events (idempotency_key, generation, kind, at)
			VALUES ('dead-old-1', 0, 'mismatch', now() - interval '2 days'), ('dead-new', 0, 'mismatch', now())`)
		n, err := l.Purge(ctx, 24*time.Hour, 2) // two batches of at most 2
		if err != nil {
			t.Fatal(err)
		}
		left := testenv.Strings(t, pool, `SELECT idempotency_key FROM job_intents ORDER BY 1`)
		want := []string{"dead-new", "dead-with-row", "published-old"}
		if n != 3 || fmt.Sprint(left) != fmt.Sprint(want) {
			t.Fatalf("index %v: purged %d, intents left %q; want 3 purged, %q left", withIndex, n, left, want)
		}
		// Histories go by the day (TestPurgeDropsHistoryByTheDay), not with their key: a
		// purged dead intent's event stays until its day ends past the window.
		if e := count(t, pool, `SELECT count(*) FROM processed_job_events WHERE idempotency_key = 'dead-old-1'`); e != 1 {
			t.Fatalf("index %v: the history of a purged dead intent: %d events, want its 1 until its day is dropped", withIndex, e)
		}
		if e := count(t, pool, `SELECT count(*) FROM processed_job_events WHERE idempotency_key = 'dead-new'`); e != 1 {
			t.Fatalf("index %v: the history of a dead intent inside the window: %d events, want 1", withIndex, e)
		}
		mu.Lock()
		// Each batch statement is observed: the ledger's one (nothing past the window), then
		// the dead intents' two (2, then 1: fewer than a batch ends it).
		if purged[idempotency.PurgeDeadIntents] != 3 || statements[idempotency.PurgeDeadIntents] != 2 ||
			purged[idempotency.PurgeLedger] != 0 || statements[idempotency.PurgeLedger] != 1 {
			t.Errorf("index %v: observed rows %v in statements %v; want job_intents 3 in 2, processed_jobs 0 in 1", withIndex, purged, statements)
		}
		mu.Unlock()
	}
}

// A retention round purges for at most its budget: past it, the round stops after its
// current batch, reports the rows it left behind (ObservePurgeBacklog), and the next
// rounds work them off, until one catches up and reports 0. Every batch is one statement
// of at most Batch rows.
func TestRetentionRoundsStopAtTheirBudget(t *testing.T) {
	t.Parallel()
	var (
		mu         sync.Mutex
		statements []string // table:rows, one per batch statement
	)
	backlogs := make(chan [2]int64, 10) // rows, validFor
	l, pool := newLedger(t, &idempotency.Config{
		ObservePurge: func(table string, rows int64, _ time.Duration) {
			mu.Lock()
			defer mu.Unlock()
			statements = append(statements, fmt.Sprintf("%s:%d", table, rows))
		},
		ObservePurgeBacklog: func(rows int64, validFor time.Duration) { backlogs <- [2]int64{rows, int64(validFor)} },
	})
	ctx := testenv.Context(t, 30*time.Second)
	mustExec(t, pool, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, started_at, completed_at)
		SELECT 'old-' || i, 'test:task', 'completed', nextval('processed_jobs_fence_seq'), now() - interval '3 days', now() - interval '2 days'
		FROM generate_series(1, 7) i`)
	mustExec(t, pool, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, started_at, completed_at)
		VALUES ('new', 'test:task', 'completed', nextval('processed_jobs_fence_seq'), now(), now())`)
	// A dead intent past the window without a row: in the backlog until the ledger's
	// purge catches up and the dead intents' runs.
	mustExec(t, pool, `INSERT INTO job_intents (idempotency_key, task_type, payload, payload_sha256, queue, max_retry,
			timeout_ms, retention_ms, state, published_at, finished_at, last_error)
		VALUES ('dead-old', 't', '\x00', sha256('\x00'), 'default', 0, 0, 0, 'dead', now() - interval '3 days', now() - interval '2 days', 'invalid payload')`)
	// No statistics, as on a fresh or bulk-loaded table: a batch read by IN (subquery)
	// was then planned as a semi join running its LIMIT once per row, deleting all 7 rows
	// in the first statement; each statement must stay within its batch however planned.

	const every = 200 * time.Millisecond
	grant := make(chan struct{}, 1)
	run, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- l.RunRetention(run, idempotency.RetentionConfig{OlderThan: 24 * time.Hour, Every: every,
			Budget: time.Nanosecond, Batch: 2, Turn: func(context.Context) bool {
				select {
				case <-grant:
					return true
				default:
					return false
				}
			}})
	}()
	// Each round deletes one batch of 2 and stops on its budget; the fourth finds the last
	// row, fewer than a batch: it has caught up and goes on to the dead intents.
	for round, want := range []struct {
		statements string
		backlog    int64 // 7 expired rows and a dead intent, less what the rounds purged
	}{
		{"[processed_jobs:2]", 6},
		{"[processed_jobs:2 processed_jobs:2]", 4},
		{"[processed_jobs:2 processed_jobs:2 processed_jobs:2]", 2},
		{"[processed_jobs:2 processed_jobs:2 processed_jobs:2 processed_jobs:1 job_intents:1]", 0},
	} {
		grant <- struct{}{}
		var got [2]int64
		select {
		case got = <-backlogs:
		case <-ctx.Done():
			t.Fatalf("round %d reported no backlog", round+1)
		}
		if got != [2]int64{want.backlog, int64(3 * every)} {
			t.Errorf("round %d: backlog %d valid for %s, want %d valid for %s", round+1, got[0], time.Duration(got[1]), want.backlog, 3*every)
		}
		mu.Lock()
		if s := fmt.Sprint(statements); s != want.statements {
			t.Errorf("round %d: statements %s, want %s", round+1, s, want.statements)
		}
		mu.Unlock()
	}
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if left := testenv.Strings(t, pool, `SELECT idempotency_key FROM processed_jobs UNION ALL SELECT idempotency_key FROM job_intents`); fmt.Sprint(left) != "[new]" {
		t.Fatalf("rows and intents left: %q, want only the row inside the window", left)
	}
}
