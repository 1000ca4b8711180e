package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/internal/release"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/migrations"
)

func TestVersionCommand(t *testing.T) {
	t.Parallel()
	out, _, err := idemq(t, nil, "version")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"\nschema   " + strconv.FormatInt(migrations.SchemaVersion(), 10) + "\n", "\ngo       " + runtime.Version() + "\n", "\ncommit   "} {
		if !strings.Contains(out, want) {
			t.Errorf("idemq version does not print %q:\n%s", want, out)
		}
	}
	// A test build carries no release's commit: it must not claim one.
	if !strings.HasPrefix(out, "version  "+release.Devel+"\n") {
		t.Errorf("idemq version of a test build:\n%s\nwant version %s", out, release.Devel)
	}
}

// --dry-run says what migrate would apply and applies nothing; --status marks each
// migration expand or contract, pending or applied.
func TestMigrateDryRunAndStatus(t *testing.T) {
	t.Parallel()
	dsn := testenv.EmptyPostgresURL(t)
	pool := testenv.Pool(t, dsn)
	env := []string{"DATABASE_URL=" + dsn}
	core, _ := filepath.Glob("../../migrations/*.sql")
	example, _ := filepath.Glob("../../migrations/example/*.sql")
	all := len(core) + len(example)

	out, stderr, err := idemq(t, env, "migrate", "--dry-run")
	if err != nil || strings.Count(out, "would apply ") != all ||
		!strings.Contains(out, "would apply 00110_idemq_processes.sql (expand)\n") ||
		!strings.Contains(out, "would apply example/00011_wallet_entries.sql (expand)\n") ||
		!strings.Contains(out, "nothing applied (dry run)") {
		t.Fatalf("migrate --dry-run on an empty schema: %v\n%s%s", err, out, stderr)
	}
	if n := testenv.Count(t, pool, "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename IN ('processed_jobs', 'wallet_entries')"); n != 0 {
		t.Fatalf("migrate --dry-run created %d of the sets' tables", n)
	}
	out, _, err = idemq(t, env, "migrate", "--status")
	if err != nil || strings.Count(out, " expand  ") != all || strings.Count(out, " pending ") != all {
		t.Fatalf("migrate --status before migrating: %v\n%s", err, out)
	}
	if _, _, err := idemq(t, env, "migrate"); err != nil {
		t.Fatal(err)
	}
	out, _, err = idemq(t, env, "migrate", "--status")
	if err != nil || strings.Count(out, " applied ") != all || !strings.Contains(out, "0 live process(es)") {
		t.Fatalf("migrate --status after migrating: %v\n%s", err, out)
	}
	out, _, err = idemq(t, env, "migrate", "--dry-run")
	if err != nil || !strings.Contains(out, "nothing to apply (dry run)") {
		t.Fatalf("migrate --dry-run on a current schema: %v\n%s", err, out)
	}
	if _, stderr, err := idemq(t, env, "migrate", "--status", "--dry-run"); err == nil || !strings.Contains(stderr, "usage: idemq migrate [--status | --dry-run]") {
		t.Fatalf("migrate --status --dry-run: %v\n%s", err, stderr)
	}
}

// The newest release's worker runs on the schema this commit migrates to: the release
// migrates a fresh schema, this commit's migrate carries it over and applies what came
// since, and the release's own enqueue and worker still turn a debit into one effect.
// The release predates idemq_processes and does not register; this commit's worker, run
// beside it, does, and deletes its row when it stops.
func TestNewestReleaseRunsOnThisSchema(t *testing.T) {
	t.Parallel()
	rs := release.List()
	r := rs[len(rs)-1]
	old := testenv.ReleaseBinary(t, r)
	takeStackSlot(t)
	ctx := testenv.Context(t, 2*time.Minute)
	dsn := testenv.EmptyPostgresURL(t)
	pool := testenv.Pool(t, dsn)
	env := []string{"DATABASE_URL=" + dsn, "REDIS_URL=" + testenv.RedisURL(t), "IDEMQ_METRICS_ADDR=", "IDEMQ_SHUTDOWN_TIMEOUT=5s"}
	runOld := releaseRunner(t, ctx, r, old, env)

	runOld("migrate")
	out, stderr, err := idemq(t, env, "migrate")
	if err != nil || !strings.Contains(out, "applied 00110_idemq_processes.sql") {
		t.Fatalf("this commit's migrate after %s's: %v\n%s%s", r.Version, err, out, stderr)
	}

	oldWorker := startBinary(t, old, "worker-"+r.Version, env, "worker")
	debit := []string{"enqueue", "debit", "--account-id", "acct-1", "--amount-cents", "125", "--reference", "upgrade-1"}
	if out := runOld(debit...); !strings.Contains(out, "debit:upgrade-1") {
		t.Fatalf("%s enqueue: %s", r.Version, out)
	}
	waitCompletedKey(t, ctx, pool, "debit:upgrade-1")
	runOld(debit...) // a duplicate: no second effect
	if out, _, err := idemq(t, env, debit...); err != nil || !strings.Contains(out, "duplicate") {
		t.Fatalf("this commit's enqueue of %s's job: %v\n%s", r.Version, err, out)
	}
	if n := testenv.Count(t, pool, "SELECT count(*) FROM idemq_processes"); n != 0 {
		t.Fatalf("%d processes registered; %s predates idemq_processes and registers none", n, r.Version)
	}

	// This commit's worker beside the release's: it registers, and says what it is.
	port := testenv.FreePort(t)
	newWorker := startIdemq(t, "worker-head", append(env, fmt.Sprintf("IDEMQ_METRICS_ADDR=127.0.0.1:%d", port)), "worker")
	testenv.WaitHTTP(t, fmt.Sprintf("http://127.0.0.1:%d/healthz", port), 30*time.Second)
	waitUntil(t, ctx, "this commit's worker's row", func() bool {
		return testenv.Count(t, pool, "SELECT count(*) FROM idemq_processes WHERE role = 'worker' AND schema_version = $1 AND pid = $2",
			migrations.SchemaVersion(), newWorker.cmd.Process.Pid) == 1
	})
	series := fmt.Sprintf(`idemq_build_info{commit="unknown",schema="%d",version="%s"}`, migrations.SchemaVersion(), release.Devel)
	if v := scrape(t, fmt.Sprintf("http://127.0.0.1:%d/metrics", port), series); v != 1 {
		t.Errorf("%s = %v, want 1", series, v)
	}
	out, _, err = idemq(t, env, "migrate", "--status")
	if err != nil || !strings.Contains(out, "1 live process(es)") || !strings.Contains(out, fmt.Sprintf("%d", newWorker.cmd.Process.Pid)) {
		t.Fatalf("migrate --status with this commit's worker running: %v\n%s", err, out)
	}
	if out := runOld("enqueue", "debit", "--account-id", "acct-1", "--amount-cents", "75", "--reference", "upgrade-2"); !strings.Contains(out, "debit:upgrade-2") {
		t.Fatalf("%s enqueue: %s", r.Version, out)
	}
	waitCompletedKey(t, ctx, pool, "debit:upgrade-2")

	for _, p := range []*proc{oldWorker, newWorker} {
		p.signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-ctx.Done():
			t.Fatalf("%s did not stop on SIGTERM", p.name)
		}
	}
	if n := testenv.Count(t, pool, "SELECT count(*) FROM idemq_processes"); n != 0 {
		t.Errorf("%d rows left in idemq_processes after a clean stop, want 0", n)
	}
	rows := testenv.Strings(t, pool, "SELECT reference || ':' || count(*) FROM wallet_entries GROUP BY reference ORDER BY reference")
	if got := strings.Join(rows, " "); got != "upgrade-1:1 upgrade-2:1" {
		t.Fatalf("wallet entries per reference: %s; want one each", got)
	}
}

// releaseRunner returns a function that runs the binary bin of release r with env and
// the arguments given, returning its output and failing the test when it fails.
func releaseRunner(t *testing.T, ctx context.Context, r release.Release, bin string, env []string) func(args ...string) string {
	return func(args ...string) string {
		t.Helper()
		cmd := exec.CommandContext(ctx, bin, args...)
		cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v\n%s", r.Version, strings.Join(args, " "), err, out)
		}
		return string(out)
	}
}

// waitCompletedKey waits until key's ledger row is completed, for up to 30 s.
func waitCompletedKey(t *testing.T, ctx context.Context, pool *pgxpool.Pool, key string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	waitUntil(t, ctx, key+" completed", func() bool {
		return testenv.Count(t, pool, "SELECT count(*) FROM processed_jobs WHERE idempotency_key = $1 AND status = 'completed'", key) == 1
	})
}

// waitUntil polls ok until it holds, failing the test when ctx ends first.
func waitUntil(t *testing.T, ctx context.Context, what string, ok func() bool) {
	t.Helper()
	for !ok() {
		select {
		case <-ctx.Done():
			t.Fatalf("no %s in time", what)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// The api and the scheduler register too, export idemq_build_info, and delete their rows
// when they stop cleanly.
func TestAPIAndSchedulerRegister(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	dsn := testenv.PostgresURL(t)
	pool := testenv.Pool(t, dsn)
	env := []string{"DATABASE_URL=" + dsn, "REDIS_URL=" + testenv.RedisURL(t), "IDEMQ_SHUTDOWN_TIMEOUT=2s"}
	apiPort, schedPort := testenv.FreePort(t), testenv.FreePort(t)
	api := startIdemq(t, "api", append(env, fmt.Sprintf("IDEMQ_HTTP_ADDR=127.0.0.1:%d", apiPort)), "api")
	sched := startIdemq(t, "scheduler", append(env, fmt.Sprintf("IDEMQ_METRICS_ADDR=127.0.0.1:%d", schedPort)), "scheduler")
	series := fmt.Sprintf(`idemq_build_info{commit="unknown",schema="%d",version="%s"}`, migrations.SchemaVersion(), release.Devel)
	for _, port := range []int{apiPort, schedPort} {
		testenv.WaitHTTP(t, fmt.Sprintf("http://127.0.0.1:%d/readyz", port), 30*time.Second)
		if v := scrape(t, fmt.Sprintf("http://127.0.0.1:%d/metrics", port), series); v != 1 {
			t.Errorf("port %d: %s = %v, want 1", port, series, v)
		}
	}
	waitUntil(t, ctx, "both rows", func() bool {
		return strings.Join(testenv.Strings(t, pool, "SELECT role || ':' || pid FROM idemq_processes ORDER BY role"), " ") ==
			fmt.Sprintf("api:%d scheduler:%d", api.cmd.Process.Pid, sched.cmd.Process.Pid)
	})
	for _, p := range []*proc{api, sched} {
		p.signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-ctx.Done():
			t.Fatalf("%s did not stop on SIGTERM", p.name)
		}
	}
	if rows := testenv.Strings(t, pool, "SELECT role FROM idemq_processes"); len(rows) != 0 {
		t.Fatalf("rows left after a clean stop: %v", rows)
	}
}
