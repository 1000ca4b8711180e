package idempotency_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// RunRetention purges at once the rows older than the window, keeps the others, and
// runs no round whose turn it does not get.
func TestRunRetentionPurgesOnItsTurn(t *testing.T) {
	t.Parallel()
	l, pool := newLedger(t, nil)
	ctx := testenv.Context(t, 30*time.Second)
	mustExec(t, pool, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, started_at, completed_at)
		VALUES ('old', 'test:task', 'completed', nextval('processed_jobs_fence_seq'), now() - interval '3 days', now() - interval '2 days'),
		       ('new', 'test:task', 'completed', nextval('processed_jobs_fence_seq'), now(), now())`)

	var asked atomic.Int64
	refused, stop := context.WithCancel(ctx)
	go func() {
		time.Sleep(300 * time.Millisecond)
		stop()
	}()
	l.RunRetention(refused, idempotency.RetentionConfig{OlderThan: 24 * time.Hour, Turn: func(context.Context) bool {
		asked.Add(1)
		return false
	}})
	if asked.Load() == 0 || count(t, pool, `SELECT count(*) FROM processed_jobs`) != 2 {
		t.Fatalf("turn asked %d times, %d rows left; want the turn asked and nothing purged", asked.Load(), count(t, pool, `SELECT count(*) FROM processed_jobs`))
	}

	granted, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- l.RunRetention(granted, idempotency.RetentionConfig{OlderThan: 24 * time.Hour}) }()
	for count(t, pool, `SELECT count(*) FROM processed_jobs WHERE idempotency_key = 'old'`) != 0 && ctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if count(t, pool, `SELECT count(*) FROM processed_jobs WHERE idempotency_key = 'new'`) != 1 {
		t.Fatal("a row inside the window was purged")
	}
	if ctx.Err() != nil {
		t.Fatal("the expired row was not purged")
	}
}
