package testenv_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/internal/testenv"
)

func TestSharedServersAreIsolated(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)

	a, b := testenv.Postgres(t), testenv.Postgres(t)
	if _, err := a.Exec(ctx, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, completed_at)
		VALUES ('k1', 't', 'completed', 1, now())`); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := b.QueryRow(ctx, `SELECT count(*) FROM processed_jobs`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("schema b sees %d rows written to schema a, want 0", n)
	}
	var sa, sb string
	a.QueryRow(ctx, `SELECT current_schema()`).Scan(&sa)
	b.QueryRow(ctx, `SELECT current_schema()`).Scan(&sb)
	if sa == sb || sa == "public" || sb == "public" {
		t.Fatalf("schemas a=%q b=%q, want two distinct private schemas", sa, sb)
	}

	ra, rb := testenv.Redis(t), testenv.Redis(t)
	if ra.Options().DB == rb.Options().DB || ra.Options().DB == 0 {
		t.Fatalf("redis databases a=%d b=%d, want two distinct non-zero numbers", ra.Options().DB, rb.Options().DB)
	}
	if err := ra.Set(ctx, "k", "a", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rb.Get(ctx, "k").Err(); !errors.Is(err, redis.Nil) {
		t.Fatalf("database b sees a's key: err=%v, want redis.Nil", err)
	}
}

func TestSchemaIsDroppedAtCleanup(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	var schema string
	t.Run("inner", func(t *testing.T) {
		pool := testenv.Postgres(t)
		if err := pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
			t.Fatal(err)
		}
	})
	probe := testenv.Postgres(t)
	var exists bool
	if err := probe.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if exists {
		t.Fatalf("schema %s still exists after its test ended", schema)
	}
}

func TestPrivatePostgresKeepsCommittedRowAcrossKill(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	ctx := testenv.Context(t, 2*time.Minute)

	if err := testenv.Migrate(ctx, pg.URL); err != nil {
		t.Fatal(err)
	}
	pool := testenv.Pool(t, pg.URL)
	if _, err := pool.Exec(ctx, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, completed_at)
		VALUES ('survives', 't', 'completed', 7, now())`); err != nil {
		t.Fatal(err)
	}
	if err := pg.Kill(); err != nil {
		t.Fatal(err)
	}
	// The backends die of their SIGKILL on their own, at once on an idle machine; one that
	// is in the middle of a disk write under load can take a while.
	for deadline := time.Now().Add(15 * time.Second); pool.Ping(ctx) == nil; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("ping still succeeds 15 s after the server was killed")
		}
	}
	if err := pg.Start(); err != nil {
		t.Fatal(err)
	}
	var fence int64
	if err := pool.QueryRow(ctx, `SELECT fence FROM processed_jobs WHERE idempotency_key = 'survives'`).Scan(&fence); err != nil {
		t.Fatalf("committed row after SIGKILL and restart: %v", err)
	}
	if fence != 7 {
		t.Fatalf("fence = %d, want 7", fence)
	}

	if err := pg.StopImmediate(); err != nil {
		t.Fatal(err)
	}
	if err := pg.Start(); err != nil {
		t.Fatal(err)
	}
	pool.Reset() // drop connections to the old server
	if err := pool.QueryRow(ctx, `SELECT fence FROM processed_jobs WHERE idempotency_key = 'survives'`).Scan(&fence); err != nil {
		t.Fatalf("committed row after immediate stop and restart: %v", err)
	}
}

func TestPrivateRedisPersistence(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		mode testenv.Persistence
		keep bool
	}{
		{"none", testenv.PersistNone, false},
		{"aof-always", testenv.PersistAOFAlways, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := testenv.StartRedis(t, tc.mode)
			ctx := testenv.Context(t, time.Minute)
			c := testenv.RedisClient(t, srv.URL)
			if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
				t.Fatal(err)
			}
			if err := srv.Kill(); err != nil {
				t.Fatal(err)
			}
			if err := srv.Start(); err != nil {
				t.Fatal(err)
			}
			got, err := c.Get(ctx, "k").Result()
			switch {
			case tc.keep && (err != nil || got != "v"):
				t.Fatalf("after kill and restart: got %q, %v; want \"v\"", got, err)
			case !tc.keep && !errors.Is(err, redis.Nil):
				t.Fatalf("after kill and restart: got %q, %v; want the key gone", got, err)
			}
		})
	}
}

func TestPrivateRedisPauseResume(t *testing.T) {
	t.Parallel()
	srv := testenv.StartRedis(t, testenv.PersistNone)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, ReadTimeout: 200 * time.Millisecond, MaxRetries: -1})
	defer c.Close()
	ctx := testenv.Context(t, time.Minute)
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	if err := c.Ping(ctx).Err(); err == nil {
		t.Fatal("ping answered by a paused server")
	}
	if err := srv.Resume(); err != nil {
		t.Fatal(err)
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var err error
	for pctx.Err() == nil {
		if err = c.Ping(pctx).Err(); err == nil {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no answer after resume: %v", err)
}

func TestPrivatePostgresStopDoesNotWaitForClients(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	pool := testenv.Pool(t, pg.URL)
	ctx := testenv.Context(t, time.Minute)
	if err := pool.Ping(ctx); err != nil { // leaves an idle connection open
		t.Fatal(err)
	}
	start := time.Now()
	if err := pg.Stop(); err != nil {
		t.Fatalf("stop with an idle client: %v", err)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("stop took %s: it waited for the idle client", d)
	}
	if err := pg.Start(); err != nil {
		t.Fatal(err)
	}
}
