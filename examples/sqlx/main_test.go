package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	"github.com/idemq/idemq/examples/internal/exampletest"
	"github.com/idemq/idemq/examples/internal/posting"
	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/idempotencytest"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/idempotency/server"
	"github.com/idemq/idemq/lock"
)

// The harness delivers a posting under every schedule (duplicates, crashes before and
// after the effect, a stale owner, an error after the effect, Redis loss, shared commits)
// and wants exactly one row for its reference each time: with the handlers' transactions
// on pgx's stdlib (the harness's default) and on lib/pq (idempotencytest.Config.SQL, each
// simulated process's sessions named so that its crash ends them).
func TestPostingsTakeEffectOnce(t *testing.T) {
	for _, driver := range []string{"pgx", "pq"} {
		t.Run(driver, func(t *testing.T) {
			pool, dsn := exampletest.Postgres(t)
			cfg := idempotencytest.Config{Pool: pool, Redis: exampletest.Redis(t), Handlers: register}
			if driver == "pq" {
				cfg.SQL = func(app string) (*sql.DB, error) {
					return sql.Open("postgres", dsn+sep(dsn)+"application_name="+url.QueryEscape(app))
				}
			}
			idempotencytest.Run(t, cfg, exampletest.PostingCase(pool))
		})
	}
}

// sep is what joins one more parameter to the URL u.
func sep(u string) string {
	if strings.Contains(u, "?") {
		return "&"
	}
	return "?"
}

// The worker as main builds it, its handlers' transactions on lib/pq (as main opens
// them) or on pgx's stdlib: each posting, accepted twice through the outbox and published
// twice more by a plain producer under TaskIDs of its own, is written once, and its
// ledger row answers the row written.
func TestServerWritesEachPostingOnce(t *testing.T) {
	for _, driver := range []string{"pq", "pgx"} {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			ctx := exampletest.Context(t, 2*time.Minute)
			pool, dsn := exampletest.Postgres(t)
			rdb := exampletest.Redis(t)
			queue := exampletest.Queue(t, rdb)
			var db *sql.DB
			if driver == "pq" {
				x, err := sqlx.Open("postgres", dsn) // the same search_path: lib/pq sends it as a run-time parameter
				if err != nil {
					t.Fatal(err)
				}
				db = x.DB
			} else {
				db = stdlib.OpenDBFromPool(pool)
			}
			t.Cleanup(func() { db.Close() })
			srv, err := server.New(server.Config{
				Postgres: pool, Redis: rdb, SQL: db,
				Queues: map[string]int{queue: 1}, Concurrency: 8, ShutdownTimeout: 5 * time.Second,
				Lock:   &lock.Config{Prefix: "idemq:{" + queue + "}:lock:"}, // the purge's lock too: deleted with the queue
				Logger: slog.New(slog.DiscardHandler),
			})
			if err != nil {
				t.Fatal(err)
			}
			register(srv)
			runCtx, stop := context.WithCancel(ctx)
			ran := make(chan error, 1)
			go func() { ran <- srv.Run(runCtx) }()
			defer func() {
				stop()
				if err := <-ran; err != nil {
					t.Errorf("Run: %v", err)
				}
			}()

			client := asynq.NewClientFromRedisClient(rdb)
			defer client.Close()
			const n = 12
			for i := range n {
				p := posting.Posting{Account: fmt.Sprintf("acct-%d", i%3), Cents: 100, Ref: fmt.Sprintf("ref-%d", i)}
				payload, err := json.Marshal(p)
				if err != nil {
					t.Fatal(err)
				}
				spec := outbox.Spec{Key: p.Key(), Type: posting.TaskType, Payload: payload, Queue: queue}
				for range 2 {
					if _, err := srv.Outbox().Enqueue(ctx, spec); err != nil {
						t.Fatal(err)
					}
				}
				for d := range 2 {
					if _, err := client.EnqueueContext(ctx, spec.Task(fmt.Sprintf("%s-dup-%d", spec.Key, d), time.Now())); err != nil {
						t.Fatal(err)
					}
				}
			}

			for i := range n {
				key := fmt.Sprintf("posting:ref-%d", i)
				r := waitCompleted(ctx, t, srv.Ledger(), key)
				var rows, id int
				if err := pool.QueryRow(ctx, `SELECT count(*), coalesce(max(id), 0) FROM postings WHERE ref = $1`, fmt.Sprintf("ref-%d", i)).Scan(&rows, &id); err != nil {
					t.Fatal(err)
				}
				var res struct {
					PostingID int `json:"posting_id"`
				}
				if err := json.Unmarshal(r.Result, &res); err != nil || rows != 1 || res.PostingID != id {
					t.Errorf("%s: %d rows (id %d), ledger result %s: want one row, answered", key, rows, id, r.Result)
				}
			}
			waitIdle(ctx, t, asynq.NewInspectorFromRedisClient(rdb), queue)
			if got, err := exampletest.Count(ctx, pool, `SELECT count(*) FROM postings`); err != nil || got != n {
				t.Errorf("postings after the duplicates ran: %d, %v; want %d", got, err, n)
			}
		})
	}
}

// waitCompleted waits until key's ledger row is completed and returns it.
func waitCompleted(ctx context.Context, t *testing.T, l *idempotency.Ledger, key string) *idempotency.Record {
	t.Helper()
	for {
		r, err := l.Get(ctx, key)
		if err == nil && r.Status == idempotency.StatusCompleted {
			return r
		}
		if ctx.Err() != nil {
			t.Fatalf("%s not completed: %+v, %v", key, r, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitIdle waits until queue has nothing left to run: every duplicate was answered.
func waitIdle(ctx context.Context, t *testing.T, insp *asynq.Inspector, queue string) {
	t.Helper()
	for {
		q, err := insp.GetQueueInfo(queue)
		if err == nil && q.Pending+q.Active+q.Scheduled+q.Retry == 0 {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("queue %s not idle: %+v, %v", queue, q, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
