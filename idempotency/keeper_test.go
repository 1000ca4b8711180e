package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
)

// TestKeeperExtendsEveryLeaseInOneStatement: handlers that run longer than their lease,
// side by side, are all kept by heartbeats that go several to a statement; a lease taken
// over in the middle cancels its own handler and no other.
func TestKeeperExtendsEveryLeaseInOneStatement(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	sizes := &batchSizes{}
	// A lease of 2 s: a heartbeat every 667 ms, and 1.8 s for each to land on a loaded
	// machine. The handlers run for 2.5 leases.
	l := New(pool, &Config{Lease: 2 * time.Second, ObserveBatch: sizes.observe})
	t.Cleanup(l.Close)
	ctx := testenv.Context(t, 2*time.Minute)

	const n = 12
	stolen := "keeper-3"
	started := make(chan struct{}, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			_, errs[i] = l.Do(ctx, testReq(fmt.Sprintf("keeper-%d", i)), func(ctx context.Context) (json.RawMessage, error) {
				started <- struct{}{}
				select {
				case <-ctx.Done():
					return nil, context.Cause(ctx)
				case <-time.After(5 * time.Second):
					return json.RawMessage(`{}`), nil
				}
			})
		})
	}
	for range n {
		<-started
	}
	if _, err := pool.Exec(ctx, `UPDATE processed_jobs SET fence = nextval('processed_jobs_fence_seq'), owner = gen_random_uuid() WHERE idempotency_key = $1`, stolen); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	for i, err := range errs {
		key := fmt.Sprintf("keeper-%d", i)
		if key == stolen {
			if !errors.Is(err, ErrLeaseLost) {
				t.Errorf("%s, taken over: %v, want ErrLeaseLost", key, err)
			}
		} else if err != nil {
			t.Errorf("%s: %v, want it completed under heartbeats", key, err)
		}
	}
	var completed int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM processed_jobs WHERE idempotency_key LIKE 'keeper-%' AND status = 'completed'`).Scan(&completed); err != nil {
		t.Fatal(err)
	}
	if completed != n-1 {
		t.Errorf("%d keys completed, want %d", completed, n-1)
	}
	sizes.mu.Lock()
	defer sizes.mu.Unlock()
	statements, beats := sizes.runs[BatchHeartbeat], sizes.sum[BatchHeartbeat]
	t.Logf("%d heartbeats in %d statements (largest %d)", beats, statements, sizes.max[BatchHeartbeat])
	// Each of the n handlers needs at least two heartbeats to outlive its lease.
	if beats < 2*(n-1) {
		t.Errorf("%d heartbeats, want at least %d", beats, 2*(n-1))
	}
	if statements == 0 || beats < 3*statements {
		t.Errorf("%d heartbeats in %d statements: want several to a statement", beats, statements)
	}
}
