package outbox_test

import (
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/testenv"
)

// A Spec without a queue is published to DefaultQueue, and only that queue is registered
// with asynq and marked: asynq's set of queues never holds "" (asynq's Inspector, the
// dashboard, refuses a queue without a name), and redis_epochs has no row for it.
func TestEnqueueWithoutAQueueRegistersDefault(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	c := outbox.NewClient(pool, rdb, nil)
	ctx := testenv.Context(t, 30*time.Second)
	res, err := c.Enqueue(ctx, outbox.Spec{Key: "k-1", Type: "t", Payload: []byte(`{}`)})
	if err != nil || res.State != outbox.IntentPublished {
		t.Fatalf("enqueue: %+v, %v; want published at once", res, err)
	}
	queues, err := rdb.SMembers(ctx, "asynq:queues").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(queues) != 1 || queues[0] != outbox.DefaultQueue {
		t.Fatalf("asynq:queues holds %q; want only %q", queues, outbox.DefaultQueue)
	}
	if n := count(t, pool, `SELECT count(*) FROM redis_epochs WHERE queue = ''`); n != 0 {
		t.Fatalf("%d redis_epochs rows for queue ''; want none", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM redis_epochs WHERE queue = 'default'`); n != 1 {
		t.Fatalf("%d redis_epochs rows for queue default; want 1", n)
	}
	if m, err := rdb.Get(ctx, "idemq:{default}:epoch").Result(); err != nil || m == "" {
		t.Fatalf("default's epoch marker: %q, %v; want one", m, err)
	}
}

// A Redis and a table that an earlier release left with the queue "" (asynq's set of
// queues, redis_epochs) are repaired by a reconcile round, on any replica and as often as
// it runs: "" is gone from both, and default has its epoch marker and row.
func TestReconcileRepairsTheEmptyQueue(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	ctx := testenv.Context(t, 30*time.Second)
	if err := rdb.SAdd(ctx, "asynq:queues", "", "other").Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.Set(ctx, "idemq:{}:epoch", "old", 0).Err(); err != nil {
		t.Fatal(err)
	}
	mustExec(t, pool, `INSERT INTO redis_epochs (queue, epoch) VALUES ('', 'old')`)
	a, b := outbox.NewClient(pool, rdb, nil), outbox.NewClient(pool, rdb, nil)
	for i, c := range []*outbox.Client{a, b, a} { // two replicas, and one of them again
		if _, err := c.Reconcile(ctx, time.Hour); err != nil {
			t.Fatalf("reconcile %d: %v", i, err)
		}
		queues, err := rdb.SMembers(ctx, "asynq:queues").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range queues {
			if q == "" {
				t.Fatalf("round %d: asynq:queues still holds \"\": %q", i, queues)
			}
		}
		if n := count(t, pool, `SELECT count(*) FROM redis_epochs WHERE queue = ''`); n != 0 {
			t.Fatalf("round %d: %d redis_epochs rows for queue ''; want none", i, n)
		}
		if n, err := rdb.Exists(ctx, "idemq:{}:epoch").Result(); err != nil || n != 0 {
			t.Fatalf("round %d: the empty queue's marker: %d, %v; want it gone", i, n, err)
		}
		m, err := rdb.Get(ctx, "idemq:{default}:epoch").Result()
		if err != nil || m == "" {
			t.Fatalf("round %d: default's epoch marker: %q, %v; want one", i, m, err)
		}
		var recorded string
		if err := pool.QueryRow(ctx, `SELECT epoch FROM redis_epochs WHERE queue = 'default'`).Scan(&recorded); err != nil || recorded != m {
			t.Fatalf("round %d: default's redis_epochs row %q, %v; want the marker %q", i, recorded, err, m)
		}
		if ok, err := rdb.SIsMember(ctx, "asynq:queues", "default").Result(); err != nil || !ok {
			t.Fatalf("round %d: default registered with asynq: %v, %v", i, ok, err)
		}
	}
}
