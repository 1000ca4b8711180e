package process_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/internal/process"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/migrations"
)

// A process registers, heartbeats, prunes rows silent for an hour, and deletes its own
// row when it stops.
func TestRegistrationLifecycle(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ctx := testenv.Context(t, 30*time.Second)
	testenv.Exec(t, pool, `INSERT INTO idemq_processes (id, role, version, commit, schema_version, host, pid, heartbeat_at)
		VALUES (gen_random_uuid(), 'worker', 'v0.1.0', 'af04e0e', 61, 'gone', 1, now() - interval '61 minutes'),
		       (gen_random_uuid(), 'worker', 'v0.1.0', 'af04e0e', 61, 'quiet', 2, now() - interval '59 minutes')`)

	reg := process.Start(ctx, pool, process.RoleScheduler, slog.New(slog.NewTextHandler(io.Discard, nil)), &process.Options{Interval: 50 * time.Millisecond})
	defer reg.Stop()
	row := func() (role, version string, schema int64, pid int, beat time.Time, err error) {
		err = pool.QueryRow(ctx, "SELECT role, version, schema_version, pid, heartbeat_at FROM idemq_processes WHERE id = $1", reg.ID).
			Scan(&role, &version, &schema, &pid, &beat)
		return
	}
	var first time.Time
	waitFor(t, "the process's row", func() bool {
		role, version, schema, pid, beat, err := row()
		if err != nil {
			return false
		}
		if role != "scheduler" || version != reg.Build.Version || schema != migrations.SchemaVersion() || pid != os.Getpid() {
			t.Fatalf("row: role %q version %q schema %d pid %d; want scheduler %q %d %d", role, version, schema, pid, reg.Build.Version, migrations.SchemaVersion(), os.Getpid())
		}
		first = beat
		return true
	})
	waitFor(t, "a later heartbeat", func() bool {
		_, _, _, _, beat, err := row()
		return err == nil && beat.After(first)
	})
	if hosts := testenv.Strings(t, pool, "SELECT host FROM idemq_processes WHERE pid IN (1, 2) ORDER BY host"); strings.Join(hosts, ",") != "quiet" {
		t.Fatalf("after heartbeats the other rows are %v, want only quiet (gone was silent for over an hour)", hosts)
	}
	reg.Stop()
	if n := testenv.Count(t, pool, "SELECT count(*) FROM idemq_processes WHERE id = $1", reg.ID); n != 0 {
		t.Fatal("Stop left the process's row")
	}
}

// A process whose database is unreachable keeps running: Start returns at once, the
// failure is logged once, and Stop returns.
func TestRegistrationIsBestEffort(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?connect_timeout=1", testenv.FreePort(t)))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var logs testenv.LogBuffer
	start := time.Now()
	reg := process.Start(context.Background(), pool, process.RoleWorker, slog.New(slog.NewTextHandler(&logs, nil)), &process.Options{Interval: 20 * time.Millisecond})
	if d := time.Since(start); d > 100*time.Millisecond {
		t.Fatalf("Start took %s: it must not wait for the database", d)
	}
	waitFor(t, "the warning", func() bool { return strings.Contains(logs.String(), "cannot register this process") })
	time.Sleep(100 * time.Millisecond)
	reg.Stop()
	if n := strings.Count(logs.String(), "cannot register this process"); n != 1 {
		t.Fatalf("logged the failure %d times, want once:\n%s", n, logs.String())
	}
}

func waitFor(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("no %s within 10s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
