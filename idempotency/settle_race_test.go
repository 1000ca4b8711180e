package idempotency_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// A finish settles its intents even when their rows are being marked published at that
// moment: the outbox publishes a job and then records the publish, so a quick worker
// completes the job while that write has not committed yet. The finish waits for the
// write's row lock and, once it commits, Postgres rechecks the newer row version against
// the statement; a statement whose recheck loses the row (as v0.1.0's shared finish did)
// leaves the intent published after its job completed. DoTx deliveries (several at once,
// sharing transactions) and leased ones (Do), each of its intent's own task.
func TestFinishSettlesIntentsBeingMarkedPublished(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	// The finishes wait for the marker's row locks for as long as the test takes to see
	// them waiting: on a loaded machine that is longer than the default ClaimLockTimeout
	// (2 s), past which a finish's lock wait makes the key busy.
	l, pool := newLedger(t, &idempotency.Config{ClaimLockTimeout: time.Minute})
	const taskType = "test:task"
	var txKeys, leasedKeys, keys []string
	for i := range 6 {
		txKeys = append(txKeys, fmt.Sprintf("racing-tx-%d", i))
	}
	for i := range 2 {
		leasedKeys = append(leasedKeys, fmt.Sprintf("racing-leased-%d", i))
	}
	keys = append(append(keys, txKeys...), leasedKeys...)
	request := func(key string) idempotency.Request {
		payload := []byte(`{"k":"` + key + `"}`)
		return idempotency.Request{Key: key, TaskType: taskType, Fingerprint: idempotency.Fingerprint(taskType, payload),
			TaskID: key, PayloadSum: idempotency.PayloadSum(taskType, payload)}
	}
	for _, key := range keys {
		mustExec(t, pool, `INSERT INTO job_intents (idempotency_key, task_type, payload, payload_sha256, queue, max_retry, timeout_ms, retention_ms)
			VALUES ($1, $2, $3, $4, 'default', 3, 1000, 1000)`, key, taskType, []byte(`{"k":"`+key+`"}`), request(key).PayloadSum)
	}

	// The relay's record of the publishes, held open: the statement the outbox sends.
	marker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer marker.Rollback(context.Background())
	if _, err := marker.Exec(ctx, `UPDATE job_intents i
		SET state = 'published', published_at = now(), publish_generation = 0, relay_until = NULL, last_error = NULL, updated_at = now()
		FROM unnest($1::text[]) AS p(key)
		WHERE i.idempotency_key = p.key AND i.state IS NOT DISTINCT FROM 'pending'`, keys); err != nil {
		t.Fatal(err)
	}
	var markerXID string
	if err := marker.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(&markerXID); err != nil {
		t.Fatal(err)
	}

	var wg sync.WaitGroup
	var ran atomic.Int32 // handlers returned: their finishes come next
	errs := make(chan error, len(keys))
	for _, key := range txKeys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := l.DoTx(ctx, request(key), func(context.Context, pgx.Tx) (json.RawMessage, error) {
				defer ran.Add(1)
				return json.RawMessage(`{"ok":true}`), nil
			})
			errs <- err
		}()
	}
	for _, key := range leasedKeys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := l.Do(ctx, request(key), func(context.Context) (json.RawMessage, error) {
				defer ran.Add(1)
				return json.RawMessage(`{"ok":true}`), nil
			})
			errs <- err
		}()
	}
	// The finishes wait for the marker's row locks (the waiters' count stable over two
	// looks) before the marker commits. A DoTx delivery the first shared transaction did
	// not take may wait for its executor, whose finish waits for the marker (a loaded
	// machine's CI saw 7 of the 8 handlers run): it runs after the commit, and settles
	// its intent all the same.
	waiting, last := 0, -1
	for waiting == 0 || waiting != last || ran.Load() < int32(len(leasedKeys)+1) {
		if ctx.Err() != nil {
			t.Fatalf("%d handlers ran, %d finishes waiting for the marker; want both leased and a shared one run, and some waiting", ran.Load(), waiting)
		}
		time.Sleep(50 * time.Millisecond)
		last = waiting
		waiting = count(t, pool, `SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted
			AND transactionid::text = $1`, markerXID)
	}
	if err := marker.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM processed_jobs WHERE idempotency_key = ANY($1) AND status = 'completed'`, keys); n != len(keys) {
		t.Fatalf("%d keys completed, want %d", n, len(keys))
	}
	open := testenv.Strings(t, pool, `SELECT idempotency_key || ' ' || state FROM job_intents WHERE state <> 'done' ORDER BY 1`)
	if len(open) > 0 {
		t.Fatalf("intents not settled by their completions: %v", open)
	}
}
