package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/internal/testenv"
)

// batchSizes records Config.ObserveBatch calls.
type batchSizes struct {
	mu   sync.Mutex
	max  map[string]int
	sum  map[string]int
	runs map[string]int
}

func (b *batchSizes) observe(kind string, n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.max == nil {
		b.max, b.sum, b.runs = map[string]int{}, map[string]int{}, map[string]int{}
	}
	b.max[kind] = max(b.max[kind], n)
	b.sum[kind] += n
	b.runs[kind]++
}

func testReq(key string) Request {
	return Request{Key: key, TaskType: "test:task", Fingerprint: Fingerprint("test:task", []byte(key))}
}

// TestGroupCommitManyDo: concurrent Do calls share claim and completion commits, and each
// key still runs once, completed with its own fence and result.
func TestGroupCommitManyDo(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	sizes := &batchSizes{}
	l := New(pool, &Config{ObserveBatch: sizes.observe})
	t.Cleanup(l.Close)
	ctx := testenv.Context(t, 2*time.Minute)

	const keys, copies = 150, 3
	var runs [keys]atomic.Int32
	results := make([][copies]Result, keys)
	var wg sync.WaitGroup
	var busy atomic.Int32
	for i := range keys {
		for j := range copies {
			wg.Go(func() {
				key := fmt.Sprintf("gc:%d", i)
				for {
					res, err := l.Do(ctx, testReq(key), func(ctx context.Context) (json.RawMessage, error) {
						runs[i].Add(1)
						return json.RawMessage(fmt.Sprintf(`{"i":%d}`, i)), nil
					})
					if errors.Is(err, ErrBusy) {
						busy.Add(1)
						time.Sleep(5 * time.Millisecond)
						continue
					}
					if err != nil {
						t.Errorf("%s: %v", key, err)
					}
					results[i][j] = res
					return
				}
			})
		}
	}
	wg.Wait()
	for i := range keys {
		if n := runs[i].Load(); n != 1 {
			t.Errorf("key %d ran %d times, want 1", i, n)
		}
		var fence int64
		if err := pool.QueryRow(ctx, `SELECT fence FROM processed_jobs WHERE idempotency_key = $1 AND status = 'completed' AND result = $2`,
			fmt.Sprintf("gc:%d", i), fmt.Sprintf(`{"i":%d}`, i)).Scan(&fence); err != nil {
			t.Errorf("key %d: completed row: %v", i, err)
		}
		fresh := 0
		for _, r := range results[i] {
			if r.Fence != fence {
				t.Errorf("key %d: result names fence %d, the row %d", i, r.Fence, fence)
			}
			if !r.Cached {
				fresh++
			}
		}
		if fresh != 1 {
			t.Errorf("key %d: %d uncached results, want 1", i, fresh)
		}
	}
	sizes.mu.Lock()
	defer sizes.mu.Unlock()
	t.Logf("batches: %v runs, %v statements, largest %v; busy answers %d", sizes.runs, sizes.sum, sizes.max, busy.Load())
	if sizes.max[BatchClaim] < 2 || sizes.max[BatchComplete] < 2 {
		t.Errorf("no shared commit carried more than one request: largest %v", sizes.max)
	}
	if sizes.sum[BatchComplete] != keys {
		t.Errorf("%d completions committed, want %d", sizes.sum[BatchComplete], keys)
	}
}

// claimOp builds a claim row for a committer batch; its answer lands in op.row.
func claimOp(t *testing.T, l *Ledger, key string) *leasedOp {
	t.Helper()
	_, p, err := l.newClaim(context.Background(), testReq(key))
	if err != nil {
		t.Fatal(err)
	}
	return &leasedOp{key: key, claim: &p}
}

// finishOp builds a completion row for a committer batch; op.answered tells whether it
// matched its row.
func finishOp(c *Claim, result string) *leasedOp {
	return &leasedOp{key: c.Key, finish: &store.FinishParams{Key: c.Key, Fence: c.Fence, Owner: c.owner,
		Action: store.ActionComplete, Result: pgtype.Text{String: result, Valid: true}}}
}

// TestGroupCommitIsolatesRefusedRow: a row the server refuses aborts its batch's
// statement; the batch is split until that row is alone, and the others commit.
func TestGroupCommitIsolatesRefusedRow(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	l := New(pool, nil)
	t.Cleanup(l.Close)
	ctx := testenv.Context(t, time.Minute)

	// Claims: one key breaks the table's CHECK (the request's own validation is skipped).
	var batch []*leasedOp
	for _, k := range []string{"a", "b", "bad key", "d", "e"} {
		batch = append(batch, claimOp(t, l, k))
	}
	errs := l.leased.Round([][]*leasedOp{nil, batch})[laneClaim]
	for i, op := range batch {
		var pgErr *pgconn.PgError
		switch {
		case op.key == "bad key":
			if !errors.As(errs[i], &pgErr) || pgErr.Code != "23514" {
				t.Errorf("bad key: err %v, want a check violation", errs[i])
			}
		case errs[i] != nil:
			t.Errorf("%s: %v", op.key, errs[i])
		case !op.row.Claimed:
			t.Errorf("%s: not claimed", op.key)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM processed_jobs WHERE status = 'in_progress'`).Scan(&n); err != nil || n != 4 {
		t.Fatalf("%d rows in progress (%v), want 4", n, err)
	}

	// Completions: one result jsonb refuses (a NUL escape), one with a stale fence.
	var claims []*Claim
	for _, k := range []string{"a", "b", "d", "e"} {
		cr, err := l.Claim(ctx, testReq(k+"2"))
		if err != nil {
			t.Fatal(err)
		}
		claims = append(claims, cr.Claim)
	}
	stale := *claims[2]
	stale.Fence--
	var ops []*leasedOp
	for i, c := range []*Claim{claims[0], claims[1], &stale, claims[3]} {
		result := `{"ok":true}`
		if i == 1 {
			result = `{"s":"\u0000"}`
		}
		ops = append(ops, finishOp(c, result))
	}
	errs = l.leased.Round([][]*leasedOp{ops, nil})[laneFinish]
	var pgErr *pgconn.PgError
	for _, i := range []int{0, 3} {
		if errs[i] != nil || !ops[i].answered {
			t.Errorf("good completion %s: err %v, updated %v", ops[i].key, errs[i], ops[i].answered)
		}
	}
	if !errors.As(errs[1], &pgErr) || pgErr.Code[:2] != "22" {
		t.Errorf("refused result: err %v, want a data exception", errs[1])
	}
	if errs[2] != nil || ops[2].answered {
		t.Errorf("stale fence: err %v, updated %v; want no error and no row", errs[2], ops[2].answered)
	}
	status := func(key string) string {
		var s string
		if err := pool.QueryRow(ctx, `SELECT status FROM processed_jobs WHERE idempotency_key = $1`, key).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	for key, want := range map[string]string{"a2": StatusCompleted, "b2": StatusInProgress, "d2": StatusInProgress, "e2": StatusCompleted} {
		if s := status(key); s != want {
			t.Errorf("%s is %s, want %s", key, s, want)
		}
	}
	// Complete turns the refused result into a marker; the stale fence is a lost lease.
	if err := l.Complete(ctx, claims[1], json.RawMessage(`{"s":"\u0000"}`)); err != nil {
		t.Errorf("Complete with a refused result: %v", err)
	}
	if s := status("b2"); s != StatusCompleted {
		t.Errorf("b2 is %s after Complete, want completed (with a marker)", s)
	}
	if err := l.Complete(ctx, &stale, nil); !errors.Is(err, ErrLeaseLost) {
		t.Errorf("Complete with a stale fence: %v, want ErrLeaseLost", err)
	}
}

// TestGroupCommitPostgresRestart: Postgres stops at once while many Do calls are committing in
// shared batches, then restarted. A Do that reported success has its row completed with
// its fence and result; every key completes once the leases end; no key runs after it
// completed.
func TestGroupCommitPostgresRestart(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	ctx := testenv.Context(t, 3*time.Minute)
	if err := testenv.Migrate(ctx, pg.URL); err != nil {
		t.Fatal(err)
	}
	pool := testenv.Pool(t, pg.URL)
	sizes := &batchSizes{}
	const lease = 2 * time.Second
	l := New(pool, &Config{Lease: lease, WriteTimeout: 5 * time.Second, ObserveBatch: sizes.observe})
	t.Cleanup(l.Close)

	const keys = 400
	type outcome struct {
		res  Result
		err  error
		runs int
	}
	var mu sync.Mutex
	out := make([]outcome, keys)
	var started atomic.Int32
	killed := make(chan struct{})
	do := func(i int) (Result, error) {
		return l.Do(ctx, testReq(fmt.Sprintf("r:%d", i)), func(context.Context) (json.RawMessage, error) {
			mu.Lock()
			out[i].runs++
			mu.Unlock()
			started.Add(1)
			return json.RawMessage(fmt.Sprintf(`{"i":%d}`, i)), nil
		})
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 40)
	for i := range keys {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			res, err := do(i)
			mu.Lock()
			out[i].res, out[i].err = res, err
			mu.Unlock()
		})
	}
	go func() {
		defer close(killed)
		for started.Load() < keys/3 {
			time.Sleep(time.Millisecond)
		}
		// An immediate stop: no checkpoint, crash recovery at the start (a SIGKILL of the
		// postmaster alone leaves its backends holding the shared memory for a while).
		if err := pg.StopImmediate(); err != nil {
			t.Error(err)
		}
		if err := pg.Start(); err != nil {
			t.Error(err)
		}
	}()
	wg.Wait()
	<-killed

	failed := 0
	for i := range keys {
		o := out[i]
		if o.err != nil {
			failed++
			continue
		}
		var fence int64
		var result string
		err := pool.QueryRow(ctx, `SELECT fence, result::text FROM processed_jobs WHERE idempotency_key = $1 AND status = 'completed'`,
			fmt.Sprintf("r:%d", i)).Scan(&fence, &result)
		if err != nil || fence != o.res.Fence || result != fmt.Sprintf(`{"i": %d}`, i) {
			t.Errorf("key %d reported completed with fence %d, but the row has fence %d, result %s (%v)", i, o.res.Fence, fence, result, err)
		}
	}
	if failed == 0 {
		t.Fatal("no Do failed: the kill missed the batches")
	}
	// Once the leases end, every key completes, and a completed key never runs again.
	for i := range keys {
		if out[i].err == nil {
			continue
		}
		deadline := time.Now().Add(time.Minute)
		for {
			res, err := do(i)
			if err == nil {
				out[i].res, out[i].err = res, nil
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("key %d: still %v", i, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	for i := range keys {
		res, err := do(i)
		if err != nil || !res.Cached || res.Fence != out[i].res.Fence {
			t.Fatalf("key %d after completion: %+v, %v; want the cached result of fence %d", i, res, err, out[i].res.Fence)
		}
	}
	twice := 0
	for i := range keys {
		if out[i].runs > 1 {
			twice++
		}
		if out[i].runs > 2 {
			t.Errorf("key %d ran %d times", i, out[i].runs)
		}
	}
	t.Logf("%d of %d Do calls failed across the kill; %d keys ran again after their lease ended; batches %v (largest %v)",
		failed, keys, twice, sizes.runs, sizes.max)
}

// TestGroupCommitRoundWithARefusedRow: completions and claims share a round's transaction;
// a claim the server refuses costs the round its single commit, not the others their
// rows: the completions and the other claims commit, the bad claim fails alone.
func TestGroupCommitRoundWithARefusedRow(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	l := New(pool, nil)
	t.Cleanup(l.Close)
	ctx := testenv.Context(t, time.Minute)

	var finishes []*leasedOp
	for _, k := range []string{"f1", "f2"} {
		cr, err := l.Claim(ctx, testReq(k))
		if err != nil {
			t.Fatal(err)
		}
		finishes = append(finishes, finishOp(cr.Claim, `{"done":true}`))
	}
	var claims []*leasedOp
	for _, k := range []string{"c1", "bad key", "c2"} {
		claims = append(claims, claimOp(t, l, k))
	}
	errs := l.leased.Round([][]*leasedOp{finishes, claims})
	for i, op := range finishes {
		if errs[laneFinish][i] != nil || !op.answered {
			t.Errorf("completion %s: err %v, updated %v", op.key, errs[laneFinish][i], op.answered)
		}
	}
	for i, op := range claims {
		err := errs[laneClaim][i]
		var pgErr *pgconn.PgError
		switch {
		case op.key == "bad key":
			if !errors.As(err, &pgErr) || pgErr.Code != "23514" {
				t.Errorf("bad key: err %v, want a check violation", err)
			}
		case err != nil || !op.row.Claimed:
			t.Errorf("claim %s: err %v, claimed %v", op.key, err, op.row.Claimed)
		}
	}
	var completed, inProgress int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'completed'), count(*) FILTER (WHERE status = 'in_progress') FROM processed_jobs`).Scan(&completed, &inProgress); err != nil {
		t.Fatal(err)
	}
	if completed != 2 || inProgress != 2 {
		t.Errorf("%d completed, %d in progress; want 2 and 2", completed, inProgress)
	}
}
