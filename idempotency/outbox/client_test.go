package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

func debitSpec(t testing.TB, ref string, amount int64) outbox.Spec {
	t.Helper()
	s, err := tasks.DebitSpec(tasks.Debit{AccountID: "a-1", AmountCents: amount, Reference: ref})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func enqueueTx(t testing.TB, pool *pgxpool.Pool, c *outbox.Client, spec outbox.Spec, commit bool) (outbox.EnqueueResult, error) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	res, err := c.EnqueueTx(ctx, tx, spec)
	if err == nil && commit {
		err = tx.Commit(ctx)
	}
	return res, err
}

func taskExists(t testing.TB, rdb *redis.Client, id string) bool {
	t.Helper()
	_, err := asynq.NewInspectorFromRedisClient(rdb).GetTaskInfo(tasks.Queue, id)
	return err == nil
}

// enqueuer records spec's intent in a transaction of its own on pool, and commits it
// when commit is set.
type enqueuer func(t testing.TB, pool *pgxpool.Pool, c *outbox.Client, spec outbox.Spec, commit bool) (outbox.EnqueueResult, error)

// enqueueSQLTx is enqueueTx through database/sql (EnqueueSQLTx over pgx's stdlib).
func enqueueSQLTx(t testing.TB, pool *pgxpool.Pool, c *outbox.Client, spec outbox.Spec, commit bool) (outbox.EnqueueResult, error) {
	t.Helper()
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	res, err := c.EnqueueSQLTx(ctx, tx, spec)
	if err == nil && commit {
		err = tx.Commit()
	}
	return res, err
}

// EnqueueTx and EnqueueSQLTx record an intent exactly when the caller's transaction
// commits; the relay publishes it; a duplicate, a mismatch and a bad spec are told apart.
func TestEnqueueTxCommitsWithTheCaller(t *testing.T) {
	t.Parallel()
	for name, enq := range map[string]enqueuer{"pgx": enqueueTx, "sql": enqueueSQLTx} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testEnqueueTxCommitsWithTheCaller(t, enq)
		})
	}
}

func testEnqueueTxCommitsWithTheCaller(t *testing.T, enq enqueuer) {
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	c := outbox.NewClient(pool, rdb, nil)
	ctx := testenv.Context(t, 30*time.Second)

	if _, err := enq(t, pool, c, debitSpec(t, "rolled-back", 5), false); err != nil {
		t.Fatal(err)
	}
	res, err := enq(t, pool, c, debitSpec(t, "committed", 5), true)
	if err != nil || res.Duplicate || res.State != outbox.IntentPending || res.Key != "debit:committed" {
		t.Fatalf("first record: %+v %v", res, err)
	}
	st, err := c.Reconcile(ctx, time.Hour) // settles nothing, checks nothing: a no-op here
	if err != nil || st.Checked != 0 {
		t.Fatalf("reconcile: %+v %v", st, err)
	}
	relayCtx, stop := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- c.RunRelay(relayCtx) }()
	// Published means both: the task is in Redis and the intent says so. Stopping the
	// relay between the two would leave the intent pending, to be published again.
	published := func() bool {
		info, err := c.Intent(ctx, "debit:committed")
		return err == nil && info.State == outbox.IntentPublished && taskExists(t, rdb, "debit:committed")
	}
	deadline := time.Now().Add(10 * time.Second)
	for !published() && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !taskExists(t, rdb, "debit:committed") {
		t.Fatal("a committed intent was not published")
	}
	if taskExists(t, rdb, "debit:rolled-back") {
		t.Fatal("a rolled-back intent was published")
	}
	if _, err := c.Intent(ctx, "debit:rolled-back"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("rolled-back intent: %v, want ErrNotFound", err)
	}
	info, err := c.Intent(ctx, "debit:committed")
	if err != nil || info.State != outbox.IntentPublished || info.PublishedAt.IsZero() {
		t.Fatalf("committed intent: %+v %v", info, err)
	}

	// Recording again: a duplicate with the same payload, a mismatch with another.
	res, err = enq(t, pool, c, debitSpec(t, "committed", 5), true)
	if err != nil || !res.Duplicate || res.State != outbox.IntentPublished {
		t.Fatalf("re-record: %+v %v, want a duplicate", res, err)
	}
	_, err = enq(t, pool, c, debitSpec(t, "committed", 6), true)
	var mm *idempotency.MismatchError
	if !errors.As(err, &mm) || mm.Key != "debit:committed" {
		t.Fatalf("re-record with another amount: %v, want a mismatch naming the key", err)
	}
	bad := debitSpec(t, "x", 1)
	bad.Key = "has space"
	if _, err := enq(t, pool, c, bad, true); !errors.Is(err, idempotency.ErrInvalidKey) {
		t.Fatalf("bad key: %v, want ErrInvalidKey", err)
	}

	// A job that declares its steps is refused when a step key would not fit, or a name
	// breaks the rule; the limit is named, and nothing is recorded.
	long := debitSpec(t, "steps", 1)
	long.Key = "debit:" + strings.Repeat("x", idempotency.MaxKeyBytes-len("debit:")-len("#s/charge")+1)
	long.Steps = []string{"charge"}
	_, err = enq(t, pool, c, long, true)
	if !errors.Is(err, idempotency.ErrInvalidKey) || !strings.Contains(err.Error(), "at most 255") {
		t.Fatalf("a step key of 256 bytes: %v, want ErrInvalidKey naming the limit", err)
	}
	long.Key = long.Key[:len(long.Key)-1]
	long.Steps = []string{"charge", "Bad Name"}
	if _, err = enq(t, pool, c, long, true); !errors.Is(err, idempotency.ErrInvalidRequest) {
		t.Fatalf("a bad step name: %v, want ErrInvalidRequest", err)
	}
	if _, err := c.Intent(ctx, long.Key); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("a refused job's intent: %v, want ErrNotFound", err)
	}
	long.Steps = []string{"charge"}
	if _, err = enq(t, pool, c, long, true); err != nil {
		t.Fatalf("a step key of 255 bytes: %v", err)
	}
}

func TestEnqueuePublishesAtOnce(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	c := outbox.NewClient(pool, rdb, nil)
	ctx := testenv.Context(t, 30*time.Second)
	res, err := c.Enqueue(ctx, debitSpec(t, "direct", 9))
	if err != nil || res.State != outbox.IntentPublished || !taskExists(t, rdb, "debit:direct") {
		t.Fatalf("Enqueue: %+v %v", res, err)
	}
	res, err = c.Enqueue(ctx, debitSpec(t, "direct", 9))
	if err != nil || !res.Duplicate {
		t.Fatalf("second Enqueue: %+v %v", res, err)
	}
}

func TestRelayReplicasPublishEachIntentOnce(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	ctx := testenv.Context(t, time.Minute)
	const n = 300
	var published atomic.Int64
	cfg := &outbox.Config{RelayBatch: 20, Observe: func(ev outbox.Event, _ string) {
		if ev == outbox.EventPublished {
			published.Add(1)
		}
	}}
	recorder := outbox.NewClient(pool, rdb, cfg)

	relayCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for range 3 {
		c := outbox.NewClient(pool, rdb, cfg)
		wg.Add(1)
		go func() { defer wg.Done(); c.RunRelay(relayCtx) }()
	}
	for i := range n {
		if _, err := enqueueTx(t, pool, recorder, debitSpec(t, fmt.Sprintf("r-%d", i), 1), true); err != nil {
			t.Fatal(err)
		}
		if i%50 == 0 {
			recorder.Wake(ctx)
		}
	}
	for published.Load() < n && ctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond) // let a double publish show, if any
	stop()
	wg.Wait()
	q, err := asynq.NewInspectorFromRedisClient(rdb).GetQueueInfo(tasks.Queue)
	if err != nil {
		t.Fatal(err)
	}
	if published.Load() != n || q.Pending != n {
		t.Fatalf("published %d times, %d tasks pending; want %d each", published.Load(), q.Pending, n)
	}
	if left := count(t, pool, `SELECT count(*) FROM job_intents WHERE state <> 'published'`); left != 0 {
		t.Fatalf("%d intents not published", left)
	}
}

func TestRelaySurvivesRedisDown(t *testing.T) {
	t.Parallel()
	srv := testenv.StartRedis(t, testenv.PersistNone)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond, ContextTimeoutEnabled: true})
	t.Cleanup(func() { rdb.Close() })
	pool := testenv.Postgres(t)
	var relayErrors atomic.Int64
	c := outbox.NewClient(pool, rdb, &outbox.Config{RelayPoll: 50 * time.Millisecond, Observe: func(ev outbox.Event, _ string) {
		if ev == outbox.EventRelayError {
			relayErrors.Add(1)
		}
	}})
	ctx := testenv.Context(t, time.Minute)
	if err := srv.Stop(); err != nil {
		t.Fatal(err)
	}
	relayCtx, stop := context.WithCancel(ctx)
	defer stop()
	go c.RunRelay(relayCtx)
	for i := range 20 {
		if _, err := enqueueTx(t, pool, c, debitSpec(t, fmt.Sprintf("down-%d", i), 1), true); err != nil {
			t.Fatal(err)
		}
	}
	for relayErrors.Load() == 0 && ctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
	}
	if n := count(t, pool, `SELECT count(*) FROM job_intents WHERE state = 'pending' AND last_error IS NOT NULL`); n == 0 {
		t.Fatal("no publish failure recorded while Redis was down")
	}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	for count(t, pool, `SELECT count(*) FROM job_intents WHERE state = 'pending'`) > 0 && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
	}
	q, err := asynq.NewInspectorFromRedisClient(rdb).GetQueueInfo(tasks.Queue)
	if err != nil || q.Pending != 20 {
		t.Fatalf("after Redis came back: %v pending (%v), want all 20 published", q, err)
	}
}

func TestReconcileRepublishesLostTasks(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	var alerts atomic.Int64
	c := outbox.NewClient(pool, rdb, &outbox.Config{AlertGeneration: 2, Observe: func(ev outbox.Event, _ string) {
		if ev == outbox.EventRepublishAlert {
			alerts.Add(1)
		}
	}})
	ctx := testenv.Context(t, time.Minute)
	for _, ref := range []string{"kept", "deleted", "orphan", "done"} {
		if _, err := c.Enqueue(ctx, debitSpec(t, ref, 1)); err != nil {
			t.Fatal(err)
		}
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	if err := insp.DeleteTask(tasks.Queue, "debit:deleted"); err != nil {
		t.Fatal(err)
	}
	// An orphaned hash: the task's message is gone, a late result write left the hash.
	if err := insp.DeleteTask(tasks.Queue, "debit:orphan"); err != nil {
		t.Fatal(err)
	}
	rdb.HSet(ctx, "asynq:{default}:t:debit:orphan", "result", "late")
	// A key the ledger completed by another task (a plain producer's): not settled by
	// that, and republished, so that the intent's own task settles it.
	mustExec(t, pool, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, completed_at)
		VALUES ('debit:done', 'wallet:debit', 'completed', nextval('processed_jobs_fence_seq'), now())`)
	if err := insp.DeleteTask(tasks.Queue, "debit:done"); err != nil {
		t.Fatal(err)
	}

	st, err := c.Reconcile(ctx, time.Hour)
	if err != nil || st.Checked != 0 {
		t.Fatalf("within the grace period: %+v %v; want nothing checked", st, err)
	}
	if info, _ := c.Intent(ctx, "debit:done"); info.State != outbox.IntentPublished {
		t.Fatalf("intent of a key completed by another task: %s, want still published", info.State)
	}
	st, err = c.Reconcile(ctx, 0)
	if err != nil || st.Checked != 4 || st.Missing != 3 || st.Republished != 3 {
		t.Fatalf("after the grace period: %+v %v; want 4 checked, 3 missing and republished", st, err)
	}
	for _, id := range []string{"debit:deleted#r1", "debit:orphan#r1", "debit:done#r1"} {
		if !taskExists(t, rdb, id) {
			t.Errorf("%s not published", id)
		}
	}
	// Redis loses everything (a restart without persistence): the whole queue is gone.
	for _, id := range []string{"debit:kept", "debit:deleted#r1", "debit:orphan#r1", "debit:done#r1"} {
		insp.DeleteTask(tasks.Queue, id)
	}
	insp.DeleteQueue(tasks.Queue, true)
	st, err = c.Reconcile(ctx, 0)
	if err != nil || st.Missing != 4 || st.Republished != 4 {
		t.Fatalf("after the queue vanished: %+v %v; want 4 republished", st, err)
	}
	// The queue is registered again although this client enqueued to it before: asynq's
	// Inspector (the dashboard) sees it.
	if _, err := insp.GetQueueInfo(tasks.Queue); err != nil {
		t.Fatalf("after republishing into an emptied Redis: %v; want the queue registered", err)
	}
	if alerts.Load() != 3 {
		t.Fatalf("alerts = %d, want 3 (the second generation of deleted, orphan and done)", alerts.Load())
	}
	info, _ := c.Intent(ctx, "debit:orphan")
	if info.PublishGeneration != 2 {
		t.Fatalf("orphan intent generation %d, want 2", info.PublishGeneration)
	}
	s, err := c.Stats(ctx, 0)
	if err != nil || s.Published != 4 || s.Pending != 0 {
		t.Fatalf("stats: %+v %v", s, err)
	}
}

func TestCompletionSettlesIntentInTheSameTransaction(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	c := outbox.NewClient(pool, rdb, nil)
	l := idempotency.New(pool, nil)
	t.Cleanup(l.Close)
	ctx := testenv.Context(t, 30*time.Second)
	for _, ref := range []string{"tx", "leased", "failed", "rolled-back"} {
		if _, err := c.Enqueue(ctx, debitSpec(t, ref, 1)); err != nil {
			t.Fatal(err)
		}
	}
	req := func(ref string) idempotency.Request {
		s := debitSpec(t, ref, 1)
		return idempotency.Request{Key: s.Key, TaskType: s.Type, Fingerprint: idempotency.Fingerprint(s.Type, s.Payload)}
	}
	if _, err := l.DoTx(ctx, req("tx"), func(context.Context, pgx.Tx) (json.RawMessage, error) { return nil, nil }); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Do(ctx, req("leased"), func(context.Context) (json.RawMessage, error) { return json.RawMessage(`1`), nil }); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Do(ctx, req("failed"), func(context.Context) (json.RawMessage, error) {
		return nil, idempotency.Permanent(errors.New("refused"))
	}); err == nil {
		t.Fatal("a permanent error was not returned")
	}
	if _, err := l.DoTx(ctx, req("rolled-back"), func(context.Context, pgx.Tx) (json.RawMessage, error) {
		return nil, errors.New("retry me")
	}); err == nil {
		t.Fatal("the handler's error was not returned")
	}
	for ref, want := range map[string]string{"tx": outbox.IntentDone, "leased": outbox.IntentDone,
		"failed": outbox.IntentDead, "rolled-back": outbox.IntentPublished} {
		info, err := c.Intent(ctx, "debit:"+ref)
		if err != nil || info.State != want {
			t.Errorf("%s: intent %+v (%v), want state %s", ref, info, err, want)
		}
	}
	// Purge takes the intents with the ledger rows.
	if n, err := l.Purge(ctx, 0, 10); err != nil || n != 3 {
		t.Fatalf("purge: %d, %v; want the 3 terminal rows", n, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM job_intents`); n != 1 {
		t.Fatalf("%d intents left after the purge, want 1 (the unfinished one)", n)
	}
}

// TestDuplicateEnqueueOfAReopenedIntentLeavesItToTheRelay: a duplicate Enqueue of a key an
// operator re-ran finds its intent pending under the rerun's publish generation. It must
// neither publish the key's first TaskID (the finished first run's task, which counts as
// published) nor mark the intent published under generation 0: that hid the rerun from
// the relays, and the next rerun reused a TaskID.
func TestDuplicateEnqueueOfAReopenedIntentLeavesItToTheRelay(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	c := outbox.NewClient(pool, rdb, nil)
	l := idempotency.New(pool, nil)
	t.Cleanup(l.Close)
	ctx := testenv.Context(t, time.Minute)
	spec := debitSpec(t, "reopened", 5)
	if res, err := c.Enqueue(ctx, spec); err != nil || res.State != outbox.IntentPublished {
		t.Fatalf("Enqueue: %+v %v", res, err)
	}
	req := idempotency.Request{Key: spec.Key, TaskType: spec.Type, Fingerprint: idempotency.Fingerprint(spec.Type, spec.Payload)}
	if _, err := l.DoTx(ctx, req, func(context.Context, pgx.Tx) (json.RawMessage, error) { return nil, nil }); err != nil {
		t.Fatal(err)
	}
	r, err := l.Rerun(ctx, spec.Key)
	if err != nil || r.TaskID != spec.Key+"#r1" {
		t.Fatalf("rerun: %+v %v; want TaskID %s#r1", r, err, spec.Key)
	}
	res, err := c.Enqueue(ctx, spec)
	if err != nil || !res.Duplicate {
		t.Fatalf("duplicate Enqueue: %+v %v", res, err)
	}
	info, err := c.Intent(ctx, spec.Key)
	if err != nil || info.State != outbox.IntentPending || info.PublishGeneration != 1 {
		t.Fatalf("intent after the duplicate: %+v (%v); want pending under publish generation 1", info, err)
	}
	// A relay publishes the rerun under its own TaskID.
	defer runRelay(ctx, c)()
	for {
		info, err := c.Intent(ctx, spec.Key)
		if err != nil {
			t.Fatal(err)
		}
		if info.State == outbox.IntentPublished {
			if info.PublishGeneration != 1 || !taskExists(t, rdb, spec.Key+"#r1") {
				t.Fatalf("intent after a relay round: %+v, task %s#r1 present %v; want both", info, spec.Key, taskExists(t, rdb, spec.Key+"#r1"))
			}
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the relay never published the rerun: %+v", info)
		case <-time.After(20 * time.Millisecond):
		}
	}
}
