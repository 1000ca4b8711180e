// Package exampletest gives the examples' tests what idempotencytest needs: a Postgres
// schema of the test's own, migrated with idemq's migrations and holding the postings
// table, and a Redis client.
package exampletest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/examples/internal/posting"
	"github.com/idemq/idemq/idempotency/idempotencytest"
	"github.com/idemq/idemq/migrations"
)

// Defaults of the servers the tests use; TEST_DATABASE_URL or DATABASE_URL, and
// TEST_REDIS_URL or REDIS_URL, point elsewhere.
const (
	DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	DefaultRedisURL    = "redis://127.0.0.1:6379/0"
)

func env(def string, names ...string) string {
	for _, n := range names {
		if v := os.Getenv(n); v != "" {
			return v
		}
	}
	return def
}

// Context is a context that ends after d or with the test.
func Context(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// Postgres creates a schema of the test's own, migrates it (idemq's migrations, then
// posting.Schema) and returns a pool on it and its URL. The URL sets search_path, which
// pgx and lib/pq both send as a run-time parameter, so every connection opened from it,
// by either driver, uses only the schema. The schema is dropped when the test ends.
func Postgres(t testing.TB) (*pgxpool.Pool, string) {
	t.Helper()
	ctx := Context(t, time.Minute)
	base := env(DefaultDatabaseURL, "TEST_DATABASE_URL", "DATABASE_URL")
	u, err := url.Parse(base)
	if err != nil {
		t.Fatalf("parse the database URL: %v", err)
	}
	var b [6]byte
	rand.Read(b[:])
	schema := "examples_" + hex.EncodeToString(b[:])
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()

	conn, err := pgx.Connect(ctx, base)
	if err != nil {
		t.Fatalf("Postgres at %s: %v", u.Redacted(), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, base)
		if err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
		}
	})

	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatalf("open pool: %v", err)
	}
	t.Cleanup(pool.Close)
	if _, err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if _, err := pool.Exec(ctx, posting.Schema); err != nil {
		t.Fatalf("create postings: %v", err)
	}
	return pool, u.String()
}

// Redis returns a client on the test's Redis, closed when the test ends. The harness
// writes only keys of its own (its queue, its lock prefix) and flushes nothing, so tests
// may share a database; a test that runs a server.Server gives it a queue of its own
// (Queue).
func Redis(t testing.TB) *redis.Client {
	t.Helper()
	opt, err := redis.ParseURL(env(DefaultRedisURL, "TEST_REDIS_URL", "REDIS_URL"))
	if err != nil {
		t.Fatalf("parse the Redis URL: %v", err)
	}
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { rdb.Close() })
	if err := rdb.Ping(Context(t, 10*time.Second)).Err(); err != nil {
		t.Fatalf("Redis at %s: %v", opt.Addr, err)
	}
	return rdb
}

// Count runs a count(*) query on pool.
func Count(ctx context.Context, pool *pgxpool.Pool, query string, args ...any) (int, error) {
	var n int
	err := pool.QueryRow(ctx, query, args...).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", query, err)
	}
	return n, nil
}

// Queue returns an asynq queue name of the test's own, for a server.Server under test
// (server.Config.Queues) and the tasks it enqueues (asynq.Queue), so that test processes
// sharing a Redis database do not take each other's tasks. The queue is deleted when the
// test ends, with every key asynq and idemq keep for it (its tasks, its counters, the
// server's Redis epoch of the queue).
func Queue(t testing.TB, rdb *redis.Client) string {
	t.Helper()
	var b [6]byte
	rand.Read(b[:])
	q := "examples-" + hex.EncodeToString(b[:])
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		// The queue may not exist (nothing was enqueued): nothing to delete.
		_ = asynq.NewInspectorFromRedisClient(rdb).DeleteQueue(q, true)
		for _, pattern := range []string{"asynq:{" + q + "}:*", "idemq:{" + q + "}:*"} {
			iter := rdb.Scan(ctx, 0, pattern, 100).Iterator()
			for iter.Next(ctx) {
				rdb.Del(ctx, iter.Val())
			}
			if err := iter.Err(); err != nil {
				t.Errorf("delete the keys of queue %s: %v", q, err)
			}
		}
	})
	return q
}

// PostingCase is the harness's case of a ledger:posting: a posting of its own for each
// schedule, whose effect is its row in postings (exactly one wanted).
func PostingCase(pool *pgxpool.Pool) idempotencytest.Case {
	return idempotencytest.Case{
		Name: "posting",
		Task: func(id string) (*asynq.Task, error) {
			return posting.NewTask(posting.Posting{Account: "acct-" + id, Cents: 250, Ref: "ref-" + id})
		},
		Effects: func(ctx context.Context, id string) (int, error) {
			return Count(ctx, pool, `SELECT count(*) FROM postings WHERE ref = $1`, "ref-"+id)
		},
	}
}
