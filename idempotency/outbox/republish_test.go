package outbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/spantest"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// plainTask enqueues, as a plain asynq producer may, a debit task of its own under TaskID
// id: nothing stops a producer from choosing a TaskID that names a republish.
func plainTask(t testing.TB, rdb *redis.Client, id, reference string) {
	t.Helper()
	payload := []byte(`{"account_id":"other","amount_cents":7,"reference":"` + reference + `"}`)
	c := asynq.NewClientFromRedisClient(rdb)
	if _, err := c.Enqueue(asynq.NewTask(tasks.TypeDebit, payload), asynq.TaskID(id), asynq.Queue(tasks.Queue)); err != nil {
		t.Fatalf("plain producer: %v", err)
	}
}

// taskPayload returns the payload of the task Redis holds under id.
func taskPayload(t testing.TB, rdb *redis.Client, id string) []byte {
	t.Helper()
	info, err := asynq.NewInspectorFromRedisClient(rdb).GetTaskInfo(tasks.Queue, id)
	if err != nil {
		t.Fatalf("task %s: %v", id, err)
	}
	return info.Payload
}

func TestKeysWithHashAreRefused(t *testing.T) {
	t.Parallel()
	if err := idempotency.ValidateKey("debit:victim#r1"); !errors.Is(err, idempotency.ErrInvalidKey) {
		t.Fatalf("ValidateKey(debit:victim#r1) = %v, want ErrInvalidKey", err)
	}
	if _, err := tasks.DebitSpec(tasks.Debit{AccountID: "a", AmountCents: 1, Reference: "victim#r1"}); err == nil {
		t.Fatal("tasks.DebitSpec accepted a reference with '#'")
	}
	pool, rdb := testenv.Pool(t, testenv.PostgresURL(t)), testenv.Redis(t)
	c := outbox.NewClient(pool, rdb, nil)
	spec := debitSpec(t, "victim", 1)
	spec.Key = "debit:victim#r1"
	if _, err := c.Enqueue(testenv.Context(t, 10*time.Second), spec); !errors.Is(err, idempotency.ErrInvalidKey) {
		t.Fatalf("Enqueue of a key with '#' = %v, want ErrInvalidKey", err)
	}
}

// A republish whose TaskID (key#r1) another task holds is not counted as published: the
// intent moves on to the next generation, whose task is really its own.
func TestReconcileSkipsTaskIDsHeldByOtherTasks(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	c := outbox.NewClient(pool, rdb, nil)
	ctx := testenv.Context(t, 30*time.Second)
	spec := debitSpec(t, "victim", 5)
	if _, err := c.Enqueue(ctx, spec); err != nil {
		t.Fatal(err)
	}
	plainTask(t, rdb, "debit:victim#r1", "someone-else")
	if err := asynq.NewInspectorFromRedisClient(rdb).DeleteTask(tasks.Queue, "debit:victim"); err != nil {
		t.Fatal(err)
	}
	st, err := c.Reconcile(ctx, 0)
	if err != nil || st.Missing != 1 || st.Republished != 1 {
		t.Fatalf("reconcile: %+v %v; want the lost task republished", st, err)
	}
	info, err := c.Intent(ctx, "debit:victim")
	if err != nil {
		t.Fatal(err)
	}
	if info.PublishGeneration != 2 {
		t.Fatalf("intent generation %d, want 2 (generation 1's TaskID is another task's)", info.PublishGeneration)
	}
	if got := taskPayload(t, rdb, "debit:victim#r2"); !bytes.Equal(got, spec.Payload) {
		t.Fatalf("debit:victim#r2 holds %s, want the intent's payload %s", got, spec.Payload)
	}
	// The round after finds the job's own task: nothing more to do.
	st, err = c.Reconcile(ctx, 0)
	if err != nil || st.Missing != 0 {
		t.Fatalf("second reconcile: %+v %v; want nothing missing", st, err)
	}
}

// A task of another job under an intent's current TaskID does not count as the intent's
// task being present.
func TestReconcileTreatsAnotherTaskUnderTheTaskIDAsMissing(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	c := outbox.NewClient(pool, rdb, nil)
	ctx := testenv.Context(t, 30*time.Second)
	spec := debitSpec(t, "taken", 5)
	if _, err := c.Enqueue(ctx, spec); err != nil {
		t.Fatal(err)
	}
	if err := asynq.NewInspectorFromRedisClient(rdb).DeleteTask(tasks.Queue, "debit:taken"); err != nil {
		t.Fatal(err)
	}
	plainTask(t, rdb, "debit:taken", "someone-else")
	st, err := c.Reconcile(ctx, 0)
	if err != nil || st.Checked != 1 || st.Missing != 1 || st.Republished != 1 {
		t.Fatalf("reconcile: %+v %v; want the intent's task found missing and republished", st, err)
	}
	if got := taskPayload(t, rdb, "debit:taken#r1"); !bytes.Equal(got, spec.Payload) {
		t.Fatalf("debit:taken#r1 holds %s, want %s", got, spec.Payload)
	}
	// The key's history tells of the republish, in the same statement that recorded it.
	var kind, taskID, worker string
	if err := pool.QueryRow(ctx, `SELECT kind, task_id, worker FROM processed_job_events WHERE idempotency_key = 'debit:taken'`).
		Scan(&kind, &taskID, &worker); err != nil || kind != "republished" || taskID != "debit:taken#r1" || worker == "" {
		t.Fatalf("history of debit:taken: %s %s %q, %v; want one republished event under debit:taken#r1 naming its worker", kind, taskID, worker, err)
	}
}

// The relay's first publish meets a TaskID a plain producer already used for another
// payload: the intent is published under the next TaskID, not marked published on the
// strength of the other task.
func TestRelaySkipsATaskIDHeldByAnotherTask(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	c := outbox.NewClient(pool, rdb, nil)
	ctx := testenv.Context(t, 30*time.Second)
	plainTask(t, rdb, "debit:pre", "someone-else")
	spec := debitSpec(t, "pre", 5)
	res, err := c.Enqueue(ctx, spec)
	if err != nil || res.State != outbox.IntentPublished {
		t.Fatalf("enqueue: %+v %v", res, err)
	}
	info, err := c.Intent(ctx, "debit:pre")
	if err != nil || info.PublishGeneration != 1 {
		t.Fatalf("intent %+v %v; want generation 1", info, err)
	}
	if got := taskPayload(t, rdb, "debit:pre#r1"); !bytes.Equal(got, spec.Payload) {
		t.Fatalf("debit:pre#r1 holds %s, want %s", got, spec.Payload)
	}
	// The job's own task under its own TaskID (a plain producer of the same job, or a
	// publish repeated after a lost answer) is a duplicate: published, generation 0.
	same := debitSpec(t, "same", 5)
	if _, _, err := tasks.Enqueue(ctx, asynq.NewClientFromRedisClient(rdb), same.Task(same.Key, time.Now())); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(ctx, same); err != nil {
		t.Fatal(err)
	}
	if info, err := c.Intent(ctx, "debit:same"); err != nil || info.PublishGeneration != 0 || info.State != outbox.IntentPublished {
		t.Fatalf("intent %+v %v; want published at generation 0", info, err)
	}
}

// waitIntentTask waits until Redis holds a task of key's intent (its current TaskID).
func waitIntentTask(ctx context.Context, t testing.TB, c *outbox.Client, rdb *redis.Client, key string) time.Duration {
	t.Helper()
	start := time.Now()
	for ctx.Err() == nil {
		if info, err := c.Intent(ctx, key); err == nil && taskExists(t, rdb, info.TaskID()) {
			return time.Since(start)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%s was not republished", key)
	return 0
}

// Redis loses everything (FLUSHDB, as a restart without persistence would) while no
// process that saw it before is running: a reconciler started afterwards notices from the
// epoch markers and republishes at once, long before the grace period.
func TestReconcilerStartedAfterTheLossRepublishesAtOnce(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	ctx := testenv.Context(t, 60*time.Second)
	before := outbox.NewClient(pool, rdb, nil)
	keys := []string{"debit:e1", "debit:e2", "debit:e3"}
	for _, ref := range []string{"e1", "e2", "e3"} {
		if _, err := before.Enqueue(ctx, debitSpec(t, ref, 1)); err != nil {
			t.Fatal(err)
		}
	}
	if err := rdb.FlushDB(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	after := outbox.NewClient(pool, rdb, &outbox.Config{Grace: time.Hour, ReconcileEvery: time.Hour, ProbeEvery: 100 * time.Millisecond})
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- after.RunReconciler(rctx) }()
	for _, k := range keys {
		if d := waitIntentTask(ctx, t, after, rdb, k); d > 10*time.Second {
			t.Errorf("%s republished after %v", k, d)
		}
	}
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// Once settled, the markers agree: nothing more is republished.
	st, err := after.Reconcile(ctx, time.Hour)
	if err != nil || st.Republished != 0 {
		t.Fatalf("reconcile after settling: %+v %v", st, err)
	}
}

// A Redis restart that keeps its data (AOF) but may have lost the last writes changes
// its run_id: a reconciler started after the restart compares it with the run_id
// Postgres recorded and checks every published intent at once.
func TestReconcilerNoticesARestartItDidNotSee(t *testing.T) {
	t.Parallel()
	srv := testenv.StartRedis(t, testenv.PersistAOFAlways)
	rdb := testenv.RedisClient(t, srv.URL)
	pool := testenv.Postgres(t)
	ctx := testenv.Context(t, 60*time.Second)

	first := outbox.NewClient(pool, rdb, &outbox.Config{Grace: time.Hour, ReconcileEvery: time.Hour, ProbeEvery: 50 * time.Millisecond})
	if _, err := first.Enqueue(ctx, debitSpec(t, "aof", 1)); err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- first.RunReconciler(rctx) }()
	for ctx.Err() == nil { // the first probe records the run_id
		var runID string
		if err := pool.QueryRow(ctx, `SELECT redis_run_id FROM redis_epochs WHERE queue = 'default'`).Scan(&runID); err == nil && runID != "" {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	<-done

	// The last write before the restart did not reach the disk: its task is gone, the
	// marker (older) is still there.
	if err := asynq.NewInspectorFromRedisClient(rdb).DeleteTask(tasks.Queue, "debit:aof"); err != nil {
		t.Fatal(err)
	}
	if err := srv.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	second := outbox.NewClient(pool, rdb, &outbox.Config{Grace: time.Hour, ReconcileEvery: time.Hour, ProbeEvery: 100 * time.Millisecond})
	rctx, stop = context.WithCancel(ctx)
	go func() { done <- second.RunReconciler(rctx) }()
	if d := waitIntentTask(ctx, t, second, rdb, "debit:aof"); d > 10*time.Second {
		t.Errorf("republished after %v", d)
	}
	stop()
	<-done
}

// A task asynq completed while the ledger never finished its key lost its completion (as
// when Postgres fails over to an asynchronous standby): the reconciler runs it again. So
// does a completed task whose key the ledger finished without settling the intent (another
// task completed it): only a delivery of the intent's own task settles it.
func TestReconcileRepublishesACompletionPostgresLost(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	c := outbox.NewClient(pool, rdb, nil)
	ctx := testenv.Context(t, time.Minute)
	lost, kept := debitSpec(t, "lost-completion", 5), debitSpec(t, "kept-completion", 6)
	for _, s := range []outbox.Spec{lost, kept} {
		if _, err := c.Enqueue(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	// asynq runs both tasks to completion with a handler that leaves no ledger row.
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{Concurrency: 2, Queues: map[string]int{tasks.Queue: 1},
		LogLevel: asynq.FatalLevel})
	if err := srv.Start(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil })); err != nil {
		t.Fatal(err)
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	for _, key := range []string{lost.Key, kept.Key} {
		for {
			info, err := insp.GetTaskInfo(tasks.Queue, key)
			if err == nil && info.State == asynq.TaskStateCompleted {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("task %s never completed: %v %v", key, info, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	srv.Shutdown()
	mustExec(t, pool, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, completed_at)
		VALUES ($1, $2, 'completed', 1, now())`, kept.Key, kept.Type)

	st, err := c.Reconcile(ctx, 0)
	if err != nil || st.Checked != 2 || st.Missing != 2 || st.Republished != 2 {
		t.Fatalf("reconcile: %+v %v; want both completions republished", st, err)
	}
	if got := taskPayload(t, rdb, lost.Key+"#r1"); !bytes.Equal(got, lost.Payload) {
		t.Fatalf("%s#r1 holds %s, want %s", lost.Key, got, lost.Payload)
	}
	if got := taskPayload(t, rdb, kept.Key+"#r1"); !bytes.Equal(got, kept.Payload) {
		t.Fatalf("%s#r1 holds %s, want %s", kept.Key, got, kept.Payload)
	}
}

// The traceparent of the context that enqueued a job is recorded with its intent and put
// in the headers of its first publish and of every republish, so a job that Redis lost is
// still one trace.
func TestTraceParentTravelsWithEveryPublish(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	c := outbox.NewClient(pool, rdb, nil)
	ctx := testenv.Context(t, 30*time.Second)
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5, 6}, TraceFlags: trace.FlagsSampled})
	const want = "00-01020300000000000000000000000000-0405060000000000-01"
	spec := debitSpec(t, "traced", 5)
	if _, err := c.Enqueue(trace.ContextWithSpanContext(ctx, sc), spec); err != nil {
		t.Fatal(err)
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	header := func(id string) string {
		t.Helper()
		info, err := insp.GetTaskInfo(tasks.Queue, id)
		if err != nil {
			t.Fatalf("task %s: %v", id, err)
		}
		return info.Headers[idempotency.HeaderTraceParent]
	}
	if got := header(spec.Key); got != want {
		t.Fatalf("first publish: traceparent %q, want %q", got, want)
	}
	if err := insp.DeleteTask(tasks.Queue, spec.Key); err != nil {
		t.Fatal(err)
	}
	if st, err := c.Reconcile(ctx, 0); err != nil || st.Republished != 1 {
		t.Fatalf("reconcile: %+v %v", st, err)
	}
	if got := header(spec.Key + "#r1"); got != want {
		t.Fatalf("republish: traceparent %q, want %q", got, want)
	}
	// An untraced context records none.
	plain := debitSpec(t, "untraced", 5)
	if _, err := c.Enqueue(ctx, plain); err != nil {
		t.Fatal(err)
	}
	if got := header(plain.Key); got != "" {
		t.Fatalf("untraced job: traceparent %q, want none", got)
	}
}

// Traced Enqueue calls recorded in one shared transaction: the transaction is a span of
// its own, idemq.enqueue, linked both ways with each caller's span.
func TestSharedEnqueueSpan(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	// One committer: the calls that come while a round commits share the next one.
	c := outbox.NewClient(testenv.Postgres(t), testenv.Redis(t), &outbox.Config{TracerProvider: tp, Committers: 1})
	ctx := testenv.Context(t, 30*time.Second)
	var wg sync.WaitGroup
	for i := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cctx, span := tp.Tracer("test").Start(ctx, "caller")
			defer span.End()
			if _, err := c.Enqueue(cctx, debitSpec(t, fmt.Sprintf("shared-%d", i), 5)); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	spantest.CheckShared(t, rec.Ended(), "idemq.enqueue", "caller")
}

// An intent whose own task asynq archived (its retries ran out: no delivery settled it) is
// settled dead by the reconciler with the task's last error, not left published forever
// and not republished; a rerun would republish it.
func TestReconcileSettlesAnArchivedTaskDead(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	var archived atomic.Int64
	c := outbox.NewClient(pool, rdb, &outbox.Config{Observe: func(ev outbox.Event, _ string) {
		if ev == outbox.EventArchived {
			archived.Add(1)
		}
	}})
	ctx := testenv.Context(t, time.Minute)
	spec := debitSpec(t, "exhausted", 3)
	spec.MaxRetry = 0
	if _, err := c.Enqueue(ctx, spec); err != nil {
		t.Fatal(err)
	}
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{Concurrency: 1, Queues: map[string]int{tasks.Queue: 1},
		LogLevel: asynq.FatalLevel})
	if err := srv.Start(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return errors.New("provider down") })); err != nil {
		t.Fatal(err)
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	for {
		info, err := insp.GetTaskInfo(tasks.Queue, spec.Key)
		if err == nil && info.State == asynq.TaskStateArchived {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("task %s never archived: %v %v", spec.Key, info, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	srv.Shutdown()

	st, err := c.Reconcile(ctx, 0)
	if err != nil || st.Archived != 1 || st.Republished != 0 {
		t.Fatalf("reconcile: %+v %v; want the archived task's intent settled, nothing republished", st, err)
	}
	info, err := c.Intent(ctx, spec.Key)
	if err != nil || info.State != outbox.IntentDead || !strings.Contains(info.LastError, "archived: provider down") {
		t.Fatalf("intent %+v %v; want dead with the task's last error", info, err)
	}
	if archived.Load() != 1 {
		t.Fatalf("%d archived events, want 1", archived.Load())
	}
	if _, err := insp.GetTaskInfo(tasks.Queue, spec.Key+"#r1"); !errors.Is(err, asynq.ErrTaskNotFound) {
		t.Fatalf("the archived job was republished: %v", err)
	}
}
