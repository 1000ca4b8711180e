package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// closedServers points Redis and Postgres at loopback ports nothing listens on, so that a
// setting the configuration wrongly accepts still ends the run at once (connection
// refused) instead of serving.
func closedServers(t *testing.T) []string {
	return []string{
		fmt.Sprintf("REDIS_URL=redis://127.0.0.1:%d/0", testenv.FreePort(t)),
		fmt.Sprintf("DATABASE_URL=postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable&connect_timeout=5", testenv.FreePort(t)),
	}
}

// A setting that would wedge a process or switch a guard off stops every subcommand that
// reads it at start, with one line naming the variable and its limit.
func TestUnsafeSettingsRefusedAtStart(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		env  string
		want []string
	}{
		{[]string{"worker"}, "IDEMQ_CONCURRENCY=99999999999", []string{"IDEMQ_CONCURRENCY", "at most 10000"}},
		{[]string{"worker"}, "IDEMQ_CONCURRENCY=10001", []string{"IDEMQ_CONCURRENCY", "at most 10000"}},
		{[]string{"worker"}, "IDEMQ_LEASE=1ms", []string{"IDEMQ_LEASE", "at least 500ms"}},
		{[]string{"worker"}, "IDEMQ_LEASE=499ms", []string{"IDEMQ_LEASE", "at least 500ms"}},
		{[]string{"worker"}, "IDEMQ_LOCK_TTL=1ns", []string{"IDEMQ_LOCK_TTL", "at least 500ms"}},
		{[]string{"worker"}, "IDEMQ_QUEUES=default:1,default:5", []string{"IDEMQ_QUEUES", `"default"`, "more than once"}},
		{[]string{"worker"}, "IDEMQ_QUEUES=default:x", []string{"IDEMQ_QUEUES", "positive whole number"}},
		{[]string{"worker"}, "IDEMQ_METRICS_ADDR=9091", []string{"IDEMQ_METRICS_ADDR", "host:port"}},
		{[]string{"api"}, "IDEMQ_API_POOL_SIZE=0", []string{"IDEMQ_API_POOL_SIZE", "at least 1"}},
		{[]string{"api"}, "IDEMQ_API_POOL_SIZE=-1", []string{"IDEMQ_API_POOL_SIZE", "at least 1"}},
		{[]string{"api"}, "IDEMQ_API_POOL_SIZE=abc", []string{`IDEMQ_API_POOL_SIZE="abc": not a valid whole number`}},
		{[]string{"api"}, "IDEMQ_API_POOL_SIZE=99999999999", []string{"IDEMQ_API_POOL_SIZE", "at most 2147483647"}},
		{[]string{"worker"}, "IDEMQ_CONCURRENCY=abc", []string{`IDEMQ_CONCURRENCY="abc": not a valid whole number`}},
		{[]string{"api"}, "IDEMQ_HTTP_ADDR=", []string{"IDEMQ_HTTP_ADDR", "empty", "127.0.0.1:8080"}},
		{[]string{"fakepay"}, "IDEMQ_FAKEPAY_ADDR=", []string{"IDEMQ_FAKEPAY_ADDR", "empty"}},
		{[]string{"worker"}, "IDEMQ_LOG_LEVEL=bogus", []string{"IDEMQ_LOG_LEVEL", `"bogus"`, "debug, info, warn, error"}},
		{[]string{"api"}, "IDEMQ_LOG_LEVEL=bogus", []string{"IDEMQ_LOG_LEVEL", `"bogus"`}},
		{[]string{"fakepay"}, "IDEMQ_LOG_LEVEL=bogus", []string{"IDEMQ_LOG_LEVEL", `"bogus"`}},
		{[]string{"migrate"}, "IDEMQ_LOG_LEVEL=bogus", []string{"IDEMQ_LOG_LEVEL", `"bogus"`}},
		{[]string{"migrate", "status"}, "IDEMQ_LOG_LEVEL=bogus", []string{"IDEMQ_LOG_LEVEL", `"bogus"`}},
		{[]string{"ledger", "list"}, "IDEMQ_LOG_LEVEL=bogus", []string{"IDEMQ_LOG_LEVEL", `"bogus"`}},
		{[]string{"enqueue", "debit", "--account-id", "a", "--amount-cents", "1", "--reference", "r"}, "IDEMQ_LOG_LEVEL=bogus", []string{"IDEMQ_LOG_LEVEL", `"bogus"`}},
	} {
		t.Run(tc.env+" "+strings.Join(tc.args, " "), func(t *testing.T) {
			t.Parallel()
			_, stderr, err := idemq(t, append(closedServers(t), tc.env), tc.args...)
			if err == nil {
				t.Fatalf("exit 0, want a refusal")
			}
			lines := strings.Split(strings.TrimSpace(stderr), "\n")
			for _, w := range tc.want {
				if len(lines) != 1 || !strings.Contains(lines[0], w) {
					t.Fatalf("stderr %q, want one line containing %q", stderr, w)
				}
			}
		})
	}
}

// The bounds themselves start: the demo's 1 s lease and lock TTL, the smallest and
// largest allowed values.
func TestBoundarySettingsStart(t *testing.T) {
	t.Parallel()
	env := []string{"DATABASE_URL=" + testenv.PostgresURL(t), "REDIS_URL=" + testenv.RedisURL(t),
		"IDEMQ_CONCURRENCY=10000", "IDEMQ_LEASE=500ms", "IDEMQ_LOCK_TTL=500ms", "IDEMQ_QUEUES=default:3,low:1"}
	port := testenv.FreePort(t)
	startIdemq(t, "worker", append(env, fmt.Sprintf("IDEMQ_METRICS_ADDR=127.0.0.1:%d", port)), "worker")
	testenv.WaitHTTP(t, fmt.Sprintf("http://127.0.0.1:%d/readyz", port), 30*time.Second)
}

// An unreachable Redis is one clean line, not go-redis's own log lines before it.
func TestUnreachableRedisIsOneLine(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"worker"},
		{"api"},
		{"enqueue", "debit", "--account-id", "a", "--amount-cents", "1", "--reference", "r"},
	} {
		t.Run(args[0], func(t *testing.T) {
			t.Parallel()
			env := append(closedServers(t), fmt.Sprintf("IDEMQ_HTTP_ADDR=127.0.0.1:%d", testenv.FreePort(t)),
				fmt.Sprintf("IDEMQ_METRICS_ADDR=127.0.0.1:%d", testenv.FreePort(t)))
			_, stderr, err := idemq(t, env, args...)
			if err == nil {
				t.Fatal("exit 0 without Redis")
			}
			lines := strings.Split(strings.TrimSpace(stderr), "\n")
			if len(lines) != 1 || !strings.Contains(lines[0], "connect to Redis (REDIS_URL)") || !strings.Contains(lines[0], "connection refused") {
				t.Fatalf("stderr %q, want one line: idemq: connect to Redis (REDIS_URL): … connection refused", stderr)
			}
		})
	}
}

// A second worker given a metrics address already in use stops before asynq starts:
// it names IDEMQ_METRICS_ADDR and takes no task.
func TestSecondWorkerOnTakenMetricsAddrStopsAtStart(t *testing.T) {
	t.Parallel()
	dsn, redisURL := testenv.PostgresURL(t), testenv.RedisURL(t)
	env := []string{"DATABASE_URL=" + dsn, "REDIS_URL=" + redisURL}
	port := testenv.FreePort(t)
	metrics := fmt.Sprintf("IDEMQ_METRICS_ADDR=127.0.0.1:%d", port)

	// The first worker holds the port and serves another queue, so the task below waits
	// for whichever worker serves tasks.Queue.
	startIdemq(t, "worker1", append([]string{metrics, "IDEMQ_QUEUES=elsewhere"}, env...), "worker")
	testenv.WaitHTTP(t, fmt.Sprintf("http://127.0.0.1:%d/readyz", port), 30*time.Second)
	out, stderr, err := idemq(t, env, "enqueue", "debit", "--account-id", "a-1", "--amount-cents", "5", "--reference", "second-worker")
	if err != nil || !strings.Contains(out, "accepted (published)") {
		t.Fatalf("enqueue: %v\n%s%s", err, out, stderr)
	}

	_, stderr, err = idemq(t, append([]string{metrics}, env...), "worker")
	if err == nil {
		t.Fatal("second worker on a taken metrics address: exit 0")
	}
	for _, want := range []string{"IDEMQ_METRICS_ADDR=127.0.0.1:", "address already in use", "IDEMQ_METRICS_ADDR=:9092"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("second worker's stderr lacks %q:\n%s", want, stderr)
		}
	}
	if strings.Contains(stderr, "worker started") {
		t.Errorf("second worker started asynq before it failed:\n%s", stderr)
	}

	pool := testenv.Pool(t, dsn)
	if n := testenv.Count(t, pool, `SELECT count(*) FROM processed_jobs WHERE idempotency_key = 'debit:second-worker'`); n != 0 {
		t.Errorf("the second worker claimed the task (%d ledger rows)", n)
	}
	info, err := asynq.NewInspectorFromRedisClient(testenv.RedisClient(t, redisURL)).GetQueueInfo(tasks.Queue)
	if err != nil {
		t.Fatal(err)
	}
	if info.Pending != 1 || info.Active != 0 || info.Retry != 0 || info.Processed != 0 {
		t.Errorf("queue %s: pending %d, active %d, retry %d, processed %d; want the task still pending, untouched",
			tasks.Queue, info.Pending, info.Active, info.Retry, info.Processed)
	}
}
