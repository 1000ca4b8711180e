package adoption_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/internal/testenv"
)

const (
	modulePath = "github.com/idemq/idemq"
	orders     = 60 // each gets a refund and a receipt
	flushAfter = 10 // completed jobs before Redis loses its data
)

// TestScratchModule adopts idemq from a module of its own, as the documentation tells a
// user to: go mod tidy, go vet and go test (the application's harness test) in that
// module; then its binary migrates a fresh schema (idemq's migrations beside the
// application's goose migrations), runs the worker, accepts 60 refunds and 60 receipts
// through the outbox, and has its Redis database flushed after some of them completed.
// Every job must complete, each refund row and each receipt exist once, every intent be
// done, and the binary exit 0 on SIGTERM.
func TestScratchModule(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs a module of its own: not with -short")
	}
	start := time.Now()
	ctx := testenv.Context(t, 3*time.Minute)
	root := repoRoot(t)
	dir := filepath.Join(t.TempDir(), "shop")
	if err := os.CopyFS(dir, os.DirFS("testdata/shop")); err != nil {
		t.Fatal(err)
	}
	gomod := fmt.Sprintf("module example.com/shop\n\ngo 1.26.8\n\nrequire %s v0.0.0\n\nreplace %s => %s\n", modulePath, modulePath, root)
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte(gomod), 0o644); err != nil {
		t.Fatal(err)
	}
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.sum"), sum, 0o644); err != nil {
		t.Fatal(err)
	}

	// Offline first: the repository builds, so its dependencies are in the module cache.
	// go mod tidy also wants the modules that the dependencies' own tests import; when the
	// cache lacks those, it asks the module proxy.
	step := time.Now()
	if out, err := goCmd(ctx, dir, []string{"GOFLAGS=-mod=mod", "GOPROXY=off"}, "mod", "tidy"); err != nil {
		if !strings.Contains(out, "GOPROXY=off") {
			t.Fatalf("go mod tidy (GOPROXY=off): %v\n%s", err, out)
		}
		t.Logf("go mod tidy offline needs modules the cache lacks; with the default GOPROXY:\n%s", lastLines(out, 4))
		if out, err := goCmd(ctx, dir, []string{"GOFLAGS=-mod=mod"}, "mod", "tidy"); err != nil {
			t.Fatalf("go mod tidy: %v\n%s", err, out)
		}
	} else {
		t.Logf("go mod tidy: offline (GOPROXY=off) in %s", time.Since(step).Round(time.Millisecond))
	}
	offline := []string{"GOPROXY=off"}

	step = time.Now()
	if out, err := goCmd(ctx, dir, offline, "vet", "./..."); err != nil {
		t.Fatalf("go vet ./...: %v\n%s", err, out)
	}
	t.Logf("go vet ./...: %s", time.Since(step).Round(time.Millisecond))

	step = time.Now()
	testEnv := append([]string{"TEST_DATABASE_URL=" + testenv.EmptyPostgresURL(t), "TEST_REDIS_URL=" + testenv.RedisURL(t)}, offline...)
	out, err := goCmd(ctx, dir, testEnv, "test", "-count=1", "-timeout=90s", "-v", "./...")
	if err != nil {
		t.Fatalf("go test ./...: %v\n%s", err, out)
	}
	if !strings.Contains(out, "--- PASS: TestExactlyOnce/receipt/redis-loss") || strings.Contains(out, "--- SKIP") {
		t.Fatalf("go test ./... passed without running every schedule:\n%s", out)
	}
	t.Logf("go test ./... (the harness on both handlers): %s\n%s", time.Since(step).Round(time.Millisecond), lastLines(out, 3))

	step = time.Now()
	bin := filepath.Join(dir, "bin", "shop")
	if out, err := goCmd(ctx, dir, offline, "build", "-o", bin, "./cmd/shop"); err != nil {
		t.Fatalf("go build ./cmd/shop: %v\n%s", err, out)
	}
	t.Logf("go build ./cmd/shop: %s; the module's Go code up to here took %s", time.Since(step).Round(time.Millisecond), time.Since(start).Round(time.Millisecond))

	runShop(ctx, t, bin)
	t.Logf("whole test: %s", time.Since(start).Round(time.Millisecond))
}

// runShop runs the application's binary: migrate, the worker, the enqueue, a Redis flush
// part-way, SIGTERM.
func runShop(ctx context.Context, t *testing.T, bin string) {
	dbURL, redisURL := testenv.EmptyPostgresURL(t), testenv.RedisURL(t)
	env := []string{"DATABASE_URL=" + dbURL, "REDIS_URL=" + redisURL}
	pool := testenv.Pool(t, dbURL)
	rdb := testenv.RedisClient(t, redisURL)
	if db := rdb.Options().DB; db == 0 {
		t.Fatalf("the leased Redis database is %d: refusing to flush it", db)
	}

	step := time.Now()
	if out, err := command(ctx, bin, env, "migrate").CombinedOutput(); err != nil {
		t.Fatalf("shop migrate: %v\n%s", err, out)
	}
	if out, err := command(ctx, bin, env, "migrate").CombinedOutput(); err != nil { // again: nothing to do
		t.Fatalf("shop migrate (again): %v\n%s", err, out)
	}
	for _, table := range []string{"processed_jobs", "job_intents", "idemq_db_version", "refunds", "receipts", "goose_db_version"} {
		if n := testenv.Count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename = $1`, table); n != 1 {
			t.Fatalf("after shop migrate, table %s is missing from the schema", table)
		}
	}
	if got := testenv.Strings(t, pool, `SELECT version_id::text FROM goose_db_version WHERE version_id > 0 ORDER BY version_id`); strings.Join(got, ",") != "1,2" {
		t.Fatalf("goose_db_version holds versions %v, want the shop's 1,2 only", got)
	}
	t.Logf("shop migrate (twice): %s", time.Since(step).Round(time.Millisecond))

	worker, logs := startWorker(ctx, t, bin, env)
	step = time.Now()
	enq := command(ctx, bin, env, "enqueue", fmt.Sprint(orders))
	var enqOut bytes.Buffer
	enq.Stdout, enq.Stderr = &enqOut, &enqOut
	if err := enq.Start(); err != nil {
		t.Fatal(err)
	}
	enqDone := make(chan error, 1)
	go func() { enqDone <- enq.Wait() }()

	// Part-way, Redis loses everything asynq and the locks had: the queue, the tasks in
	// flight, the epoch marker.
	var doneAtFlush, acceptedAtFlush int
	for {
		doneAtFlush = completed(t, pool)
		if doneAtFlush >= flushAfter {
			break
		}
		if time.Since(step) > 30*time.Second {
			t.Fatalf("only %d jobs completed within 30s\nworker:\n%s\nenqueue:\n%s", doneAtFlush, logs, enqOut.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	acceptedAtFlush = testenv.Count(t, pool, `SELECT count(*) FROM job_intents`)
	queued, _ := rdb.DBSize(ctx).Result()
	if err := rdb.FlushDB(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	flushed := time.Now()
	t.Logf("FLUSHDB of Redis database %d (%d keys) %s after the enqueue began: %d of %d jobs completed, %d accepted",
		rdb.Options().DB, queued, flushed.Sub(step).Round(time.Millisecond), doneAtFlush, 2*orders, acceptedAtFlush)
	if doneAtFlush == 2*orders {
		t.Fatalf("every job completed before the flush: the test saw no loss")
	}

	select {
	case err := <-enqDone:
		if err != nil {
			t.Fatalf("shop enqueue: %v\n%s", err, enqOut.String())
		}
	case <-ctx.Done():
		t.Fatalf("shop enqueue did not finish")
	}

	deadline := flushed.Add(60 * time.Second)
	for completed(t, pool) < 2*orders {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d jobs completed 60s after the flush\nnot completed: %v\nworker:\n%s", completed(t, pool), 2*orders,
				testenv.Strings(t, pool, `SELECT idempotency_key || ' ' || state FROM job_intents i WHERE NOT EXISTS
					(SELECT FROM processed_jobs p WHERE p.idempotency_key = i.idempotency_key AND p.status = 'completed') ORDER BY 1 LIMIT 20`), logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("every job completed %s after the flush (%s after the enqueue began)", time.Since(flushed).Round(time.Millisecond), time.Since(step).Round(time.Millisecond))

	checkEffects(t, pool)
	if n := testenv.Count(t, pool, `SELECT count(*) FROM job_intents WHERE state <> 'done'`); n != 0 {
		t.Errorf("%d intents are not done", n)
	}
	republished := testenv.Count(t, pool, `SELECT count(*) FROM job_intents WHERE publish_generation > 0`)
	t.Logf("intents republished by the reconciler: %d", republished)
	if republished == 0 {
		t.Errorf("no intent was republished: the flush lost no task, or the reconciler missed it")
	}

	step = time.Now()
	if err := worker.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- worker.Wait() }()
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("shop after SIGTERM: %v, want exit status 0\n%s", err, logs)
		}
	case <-time.After(40 * time.Second):
		t.Fatalf("shop did not exit within 40s of SIGTERM\n%s", logs)
	}
	t.Logf("shop exited 0 %s after SIGTERM", time.Since(step).Round(time.Millisecond))
}

// checkEffects wants one refund row per order and one receipt per receipt key.
func checkEffects(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	want := make([]string, orders)
	for i := range want {
		want[i] = fmt.Sprintf("o-%d 1", i+1)
	}
	byOrder := `ORDER BY length(order_id), order_id`
	if got := testenv.Strings(t, pool, `SELECT order_id || ' ' || count(*) FROM refunds GROUP BY order_id `+byOrder); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("refunds per order: %v, want one for each of o-1 … o-%d", got, orders)
	}
	if got := testenv.Strings(t, pool, `SELECT order_id || ' ' || count(*) FROM receipts GROUP BY order_id `+byOrder); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("receipts per order: %v, want one for each of o-1 … o-%d", got, orders)
	}
	if n := testenv.Count(t, pool, `SELECT count(*) FROM receipts WHERE idempotency_key <> 'receipt:' || order_id`); n != 0 {
		t.Errorf("%d receipts were sent under a key other than the job's", n)
	}
	calls := testenv.Count(t, pool, `SELECT coalesce(sum(calls), 0) FROM receipts`)
	t.Logf("receipts: %d, provider calls: %d (a call again is a retry with the same key, which the provider dedups)", orders, calls)
}

// completed counts the jobs completed in the ledger.
func completed(t *testing.T, pool *pgxpool.Pool) int {
	return testenv.Count(t, pool, `SELECT count(*) FROM processed_jobs WHERE status = 'completed'`)
}

// startWorker starts the shop's worker; it is killed when the test ends if still running.
func startWorker(ctx context.Context, t *testing.T, bin string, env []string) (*exec.Cmd, *testenv.LogBuffer) {
	t.Helper()
	logs := &testenv.LogBuffer{}
	cmd := command(ctx, bin, env)
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
		if t.Failed() {
			t.Logf("worker log:\n%s", logs)
		}
	})
	return cmd, logs
}

// command runs the shop's binary with env added to a copy of this process's environment
// without its database and Redis settings.
func command(ctx context.Context, bin string, env []string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(cleanEnv(), env...)
	return cmd
}

// goCmd runs the go command in dir with env added and returns its combined output.
func goCmd(ctx context.Context, dir string, env []string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = dir
	cmd.Env = append(cleanEnv(), env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// cleanEnv is this process's environment without what points at servers or changes the
// go command's module handling.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		switch name {
		case "DATABASE_URL", "REDIS_URL", "TEST_DATABASE_URL", "TEST_REDIS_URL", "GOFLAGS", "GOPROXY", "GOWORK":
			continue
		}
		env = append(env, kv)
	}
	return append(env, "GOWORK=off")
}

// repoRoot finds the root of the idemq module above the test's working directory.
func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && strings.HasPrefix(string(b), "module "+modulePath+"\n") {
			return dir
		}
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Fatal(err)
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatalf("no go.mod of %s above the working directory", modulePath)
		}
		dir = parent
	}
}

// lastLines returns the last n lines of s.
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
