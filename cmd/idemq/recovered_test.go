package main

import (
	"fmt"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// TestWorkerCountsRecoveredTasks kills a worker in the middle of a charge and checks that
// the next worker counts the task asynq recovers from the dead one's expired lease in
// idemq_asynq_recovered_total, while asynq still records the attempt as failed (the task
// waits in retry with asynq's ErrLeaseExpired). asynq recovers a task only 30 s after its
// 30 s lease ended; the test moves the lease's end back in Redis instead of waiting.
func TestWorkerCountsRecoveredTasks(t *testing.T) {
	t.Parallel()
	dsn, rurl := testenv.PostgresURL(t), testenv.RedisURL(t)
	rdb := testenv.RedisClient(t, rurl)
	provider := newGatedProvider("charge:o-recovered")
	fake := httptest.NewServer(provider)
	t.Cleanup(fake.Close)
	t.Cleanup(func() { provider.open("charge:o-recovered") })
	env := []string{
		"DATABASE_URL=" + dsn, "REDIS_URL=" + rurl, "IDEMQ_FAKEPAY_URL=" + fake.URL,
		"IDEMQ_CONCURRENCY=2", "IDEMQ_LEASE=2s", "IDEMQ_LOCK_TTL=2s", "IDEMQ_SHUTDOWN_TIMEOUT=2s",
	}
	startWorker := func(name string) (*proc, string) {
		port := testenv.FreePort(t)
		p := startIdemq(t, name, append([]string{fmt.Sprintf("IDEMQ_METRICS_ADDR=127.0.0.1:%d", port)}, env...), "worker")
		base := fmt.Sprintf("http://127.0.0.1:%d", port)
		testenv.WaitHTTP(t, base+"/readyz", 30*time.Second)
		return p, base + "/metrics"
	}
	first, firstMetrics := startWorker("worker0")

	spec, err := tasks.ChargeSpec(tasks.Charge{OrderID: "o-recovered", CustomerID: "c-1", AmountCents: 500, Currency: "EUR"})
	if err != nil {
		t.Fatal(err)
	}
	client := asynq.NewClientFromRedisClient(rdb)
	info, err := client.Enqueue(spec.Task(spec.Key, time.Now()))
	if err != nil {
		t.Fatal(err)
	}
	provider.waitEntered(t, spec.Key)
	if got := metricSum(t, firstMetrics, "idemq_asynq_recovered_total"); got != 0 {
		t.Fatalf("recovered before any worker died: %v", got)
	}
	first.signal(syscall.SIGKILL)
	<-first.done

	// The dead worker's lease on the task: make it end 2 minutes ago.
	ctx := testenv.Context(t, time.Minute)
	leaseKey := "asynq:{" + info.Queue + "}:lease"
	if err := rdb.ZAdd(ctx, leaseKey, redis.Z{Score: float64(time.Now().Add(-2 * time.Minute).Unix()), Member: info.ID}).Err(); err != nil {
		t.Fatal(err)
	}

	_, metrics := startWorker("worker1")
	insp := asynq.NewInspectorFromRedisClient(rdb)
	deadline := time.Now().Add(15 * time.Second)
	for metricSum(t, metrics, "idemq_asynq_recovered_total", `task_type="payment:charge"`) < 1 {
		if time.Now().After(deadline) {
			t.Fatalf("idemq_asynq_recovered_total{task_type=\"payment:charge\"} stayed 0 after the task's lease expired")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if got := metricSum(t, metrics, "idemq_asynq_recovered_total"); got != 1 {
		t.Errorf("idemq_asynq_recovered_total = %v, want 1", got)
	}
	// asynq's own view is unchanged: the attempt failed, the task waits for its retry.
	ti, err := insp.GetTaskInfo(info.Queue, info.ID)
	if err != nil {
		t.Fatal(err)
	}
	if ti.State != asynq.TaskStateRetry || ti.Retried != 1 || !strings.Contains(ti.LastErr, asynq.ErrLeaseExpired.Error()) {
		t.Errorf("task after recovery: state %v, retried %d, last error %q; want retry, 1, %q", ti.State, ti.Retried, ti.LastErr, asynq.ErrLeaseExpired)
	}
}
