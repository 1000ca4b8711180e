package outbox_test

import (
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/testenv"
)

// EnqueueManyTx gives each spec its own outcome: new, a duplicate of a committed intent
// or of an earlier spec of the batch, a mismatch, an invalid key; none spoils the others.
func TestEnqueueManyTxOutcomesPerSpec(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	c := outbox.NewClient(pool, rdb, nil)
	ctx := testenv.Context(t, 30*time.Second)
	for _, s := range []outbox.Spec{debitSpec(t, "old", 1), debitSpec(t, "other", 1)} {
		if _, err := enqueueTx(t, pool, c, s, true); err != nil {
			t.Fatal(err)
		}
	}
	bad := debitSpec(t, "bad", 1)
	bad.Key = "has space"
	specs := []outbox.Spec{debitSpec(t, "new", 1), debitSpec(t, "old", 1), debitSpec(t, "other", 2), bad, debitSpec(t, "new", 1)}
	var res []outbox.EnqueueResult
	var errs []error
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		res, errs, err = c.EnqueueManyTx(ctx, tx, specs, false)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if errs[0] != nil || res[0].Duplicate || res[0].State != outbox.IntentPending {
		t.Fatalf("new: %+v %v", res[0], errs[0])
	}
	if errs[1] != nil || !res[1].Duplicate {
		t.Fatalf("committed before: %+v %v, want a duplicate", res[1], errs[1])
	}
	var mm *idempotency.MismatchError
	if !errors.As(errs[2], &mm) || mm.Key != "debit:other" {
		t.Fatalf("another amount: %v, want a mismatch naming debit:other", errs[2])
	}
	if !errors.Is(errs[3], idempotency.ErrInvalidKey) {
		t.Fatalf("bad key: %v, want ErrInvalidKey", errs[3])
	}
	if errs[4] != nil || !res[4].Duplicate {
		t.Fatalf("the batch's second spec of debit:new: %+v %v, want a duplicate", res[4], errs[4])
	}
	if n := count(t, pool, `SELECT count(*) FROM job_intents`); n != 3 {
		t.Fatalf("%d intents, want 3 (old, other, new)", n)
	}
}

// A spec without a queue goes to asynq's default queue, as an asynq task without one does;
// one without a task type is refused.
func TestEnqueueDefaultsTheQueue(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	c := outbox.NewClient(pool, rdb, nil)
	ctx := testenv.Context(t, 30*time.Second)
	spec := debitSpec(t, "no-queue", 1)
	spec.Queue = ""
	if _, err := c.Enqueue(ctx, spec); err != nil {
		t.Fatalf("a spec without a queue: %v", err)
	}
	if n := count(t, pool, `SELECT count(*) FROM job_intents WHERE idempotency_key = 'debit:no-queue' AND queue = 'default'`); n != 1 {
		t.Fatalf("%d intents of debit:no-queue in queue default, want 1", n)
	}
	info, err := asynq.NewInspectorFromRedisClient(rdb).GetTaskInfo(outbox.DefaultQueue, spec.Key)
	if err != nil {
		t.Fatalf("the task is not in asynq's default queue: %v", err)
	}
	if info.MaxRetry != spec.MaxRetry || spec.MaxRetry == 0 {
		t.Fatalf("MaxRetry %d, want the spec's %d", info.MaxRetry, spec.MaxRetry)
	}
	spec = debitSpec(t, "no-type", 1)
	spec.Type = ""
	if _, err := c.Enqueue(ctx, spec); !errors.Is(err, idempotency.ErrInvalidRequest) {
		t.Fatalf("a spec without a task type: %v, want ErrInvalidRequest", err)
	}
}

// Concurrent Enqueue calls share transactions (intents recorded by one transaction share
// its start time, created_at's now()), each is recorded and published once, and a mismatch among them fails only
// its own call.
func TestConcurrentEnqueuesShareCommits(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	c := outbox.NewClient(pool, rdb, nil)
	ctx := testenv.Context(t, time.Minute)
	const n, mismatches = 64, 4
	for i := range mismatches {
		if _, err := c.Enqueue(ctx, debitSpec(t, fmt.Sprintf("m-%d", i), 1)); err != nil {
			t.Fatal(err)
		}
	}
	errs := make([]error, n+mismatches)
	res := make([]outbox.EnqueueResult, n+mismatches)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n + mismatches {
		wg.Add(1)
		go func() {
			defer wg.Done()
			spec := debitSpec(t, fmt.Sprintf("r-%d", i), 5)
			if i >= n {
				spec = debitSpec(t, fmt.Sprintf("m-%d", i-n), 2)
			}
			<-start
			res[i], errs[i] = c.Enqueue(ctx, spec)
		}()
	}
	close(start)
	wg.Wait()
	for i := range n {
		if errs[i] != nil || res[i].Duplicate || res[i].State != outbox.IntentPublished {
			t.Fatalf("r-%d: %+v %v, want published", i, res[i], errs[i])
		}
		if !taskExists(t, rdb, fmt.Sprintf("debit:r-%d", i)) {
			t.Fatalf("debit:r-%d is not in Redis", i)
		}
	}
	for i := n; i < n+mismatches; i++ {
		if !errors.Is(errs[i], idempotency.ErrMismatch) {
			t.Fatalf("m-%d with another amount: %v, want a mismatch", i-n, errs[i])
		}
	}
	if got := count(t, pool, `SELECT count(*) FROM job_intents WHERE idempotency_key LIKE 'debit:r-%'`); got != n {
		t.Fatalf("%d intents, want %d", got, n)
	}
	commits := count(t, pool, `SELECT count(DISTINCT created_at) FROM job_intents WHERE idempotency_key LIKE 'debit:r-%'`)
	if commits >= n {
		t.Fatalf("%d calls took %d transactions: none shared", n, commits)
	}
	t.Logf("%d concurrent calls recorded in %d transactions", n, commits)
}

// An intent recorded for the caller to publish is left alone by the relays for RelayHold;
// if the caller never publishes it, a relay does once the hold ends.
func TestSelfPublishedIntentFallsBackToTheRelay(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	const hold = 700 * time.Millisecond
	c := outbox.NewClient(pool, rdb, &outbox.Config{RelayHold: hold, RelayPoll: 50 * time.Millisecond})
	ctx := testenv.Context(t, 30*time.Second)
	defer runRelay(ctx, c)()

	committed := time.Now()
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, errs, err := c.EnqueueManyTx(ctx, tx, []outbox.Spec{debitSpec(t, "held", 1)}, true)
		if err == nil {
			err = errs[0]
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	c.Wake(ctx) // even woken, the relays leave it to its caller
	for !taskExists(t, rdb, "debit:held") {
		if time.Since(committed) > 10*time.Second {
			t.Fatal("the relay never published an intent its caller did not")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if took := time.Since(committed); took < hold/2 {
		t.Fatalf("a relay published the held intent after %s; the hold is %s", took, hold)
	}
}
