package asynqkeys_test

import (
	"slices"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/idempotency/internal/asynqkeys"
	"github.com/idemq/idemq/internal/testenv"
)

// The layout these names assume is asynq's: a task enqueued by asynq's own client is found
// under Task with its message, and its queue in AllQueues.
func TestLayoutIsAsynqs(t *testing.T) {
	t.Parallel()
	rdb := testenv.Redis(t)
	ctx := testenv.Context(t, 10*time.Second)
	c := asynq.NewClientFromRedisClient(rdb)
	if _, err := c.EnqueueContext(ctx, asynq.NewTask("layout:probe", []byte(`{}`)), asynq.TaskID("probe-1"), asynq.Queue("layout")); err != nil {
		t.Fatal(err)
	}
	msg, err := rdb.HGet(ctx, asynqkeys.Task("layout", "probe-1"), "msg").Bytes()
	if err != nil || len(msg) == 0 {
		t.Fatalf("no message at %s: %v; asynq's task key layout changed", asynqkeys.Task("layout", "probe-1"), err)
	}
	if keys, err := rdb.Keys(ctx, asynqkeys.QueuePattern("layout")).Result(); err != nil || !slices.Contains(keys, asynqkeys.Task("layout", "probe-1")) {
		t.Fatalf("%s matches %v (%v), not the task's hash; asynq's queue hash tag changed", asynqkeys.QueuePattern("layout"), keys, err)
	}
	if ok, err := rdb.SIsMember(ctx, asynqkeys.AllQueues, "layout").Result(); err != nil || !ok {
		t.Fatalf("queue not in %s: %v %v; asynq's queue set changed", asynqkeys.AllQueues, ok, err)
	}
	if err := asynq.NewInspectorFromRedisClient(rdb).DeleteTask("layout", "probe-1"); err != nil {
		t.Fatal(err)
	}
	if n, err := rdb.Exists(ctx, asynqkeys.Task("layout", "probe-1")).Result(); err != nil || n != 0 {
		t.Fatalf("the task hash outlived its deletion: %d %v", n, err)
	}
}
