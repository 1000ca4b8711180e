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

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/testenv"
)

// TestDoTxScopeTakesTurns: concurrent DoTx calls of one Request.Scope never run their
// handlers at the same time, each takes effect once, and those that meet share
// transactions; under every way a delivery can leave a shared transaction (an optimistic
// one undone by a failing member, savepoints, handlers too slow to share, group commit
// off) the scope still runs one delivery at a time. Another scope runs beside it.
func TestDoTxScopeTakesTurns(t *testing.T) {
	for _, mode := range []string{"optimistic", "savepoints", "slow", "alone"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx := testenv.Context(t, 2*time.Minute)
			pool := testenv.Postgres(t)
			var mu sync.Mutex
			maxBatch, shared := 0, 0
			events := map[Event]int{}
			l := New(pool, &Config{
				DisableGroupCommit: mode == "alone",
				Observe:            func(ev Event, _ string) { mu.Lock(); events[ev]++; mu.Unlock() },
				ObserveBatch: func(kind string, size int) {
					mu.Lock()
					defer mu.Unlock()
					if kind == BatchTx && size > 1 {
						shared += size
						maxBatch = max(maxBatch, size)
					}
				},
			})
			defer l.Close()
			l.tx.Budget, l.tx.Slow = time.Hour, time.Hour
			switch mode {
			case "savepoints":
				l.tx.SavepointsUntil(time.Now().Add(time.Hour))
			case "slow":
				l.tx.Slow = 0 // every handler is slow once one was timed: alone, in turn
			}
			batchExec(t, pool, `CREATE TABLE effects (key text NOT NULL, scope text NOT NULL)`)

			// in[scope] counts the scope's handlers running now; overlap records a second.
			var in [2]atomic.Int32
			var overlap atomic.Int32
			var failed sync.Map // keys whose first run failed on purpose
			const perScope = 40
			var wg sync.WaitGroup
			for s := range 2 {
				for i := range perScope {
					wg.Go(func() {
						key := fmt.Sprintf("s%d-k%02d", s, i)
						req := batchReq(key)
						req.Scope = fmt.Sprintf("account:%d", s)
						for attempt := 0; ; attempt++ {
							_, err := l.DoTx(ctx, req, func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
								if in[s].Add(1) > 1 {
									overlap.Add(1)
								}
								defer in[s].Add(-1)
								time.Sleep(200 * time.Microsecond) // long enough for an overlap to show
								if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, $2)`, key, req.Scope); err != nil {
									return nil, err
								}
								if i%7 == 3 {
									if _, done := failed.LoadOrStore(key, true); !done {
										return nil, errors.New("first run fails")
									}
								}
								return json.RawMessage(`{}`), nil
							})
							if err == nil {
								return
							}
							if attempt > 0 || i%7 != 3 {
								t.Errorf("%s: %v", key, err)
								return
							}
						}
					})
				}
			}
			wg.Wait()
			if n := overlap.Load(); n != 0 {
				t.Fatalf("%d handlers ran while another of their scope ran", n)
			}
			for s := range 2 {
				if got := batchCount(t, pool, `SELECT count(DISTINCT key) FROM effects WHERE scope = $1`, fmt.Sprintf("account:%d", s)); got != perScope {
					t.Fatalf("scope %d: %d keys took effect, want %d", s, got, perScope)
				}
			}
			if got := batchCount(t, pool, `SELECT count(*) FROM effects`); got != 2*perScope {
				t.Fatalf("effects = %d, want %d (one per key)", got, 2*perScope)
			}
			mu.Lock()
			defer mu.Unlock()
			switch mode {
			case "optimistic", "savepoints":
				if maxBatch < 2 || shared < perScope/2 {
					t.Fatalf("shared transactions carried %d deliveries, at most %d in one: the scope's deliveries did not share", shared, maxBatch)
				}
			case "alone":
				if shared != 0 {
					t.Fatalf("%d deliveries shared a transaction, want none (group commit off)", shared)
				}
			}
			if mode == "optimistic" && events[EventSharedRerun] == 0 {
				t.Fatalf("no optimistic transaction was undone (events %v): the failing members did not exercise it", events)
			}
		})
	}
}

// TestDoTxScopeLineLeaderKeyIsFreed: a scope's line is taken into its head's shared
// transaction, and the batch sorts by key, so the head may run after the deliveries it
// took; once done, the head's key is free again: a second delivery of it (a redelivery,
// answered from the ledger) does not wait forever behind a key left in flight.
func TestDoTxScopeLineLeaderKeyIsFreed(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	pool := testenv.Postgres(t)
	var mu sync.Mutex
	shared := 0
	l := New(pool, &Config{ObserveBatch: func(kind string, size int) {
		if kind == BatchTx && size > 1 {
			mu.Lock()
			shared += size
			mu.Unlock()
		}
	}})
	defer l.Close()
	l.tx.Budget, l.tx.Slow = time.Hour, time.Hour
	const scope = "account:line"
	do := func(ctx context.Context, key string, fn func()) error {
		req := batchReq(key)
		req.Scope = scope
		_, err := l.DoTx(ctx, req, func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			if fn != nil {
				fn()
			}
			_, err := tx.Exec(ctx, `SELECT 1`)
			return json.RawMessage(`{}`), err
		})
		return err
	}
	// m-first holds the scope until z-head and the a-keys wait in its line, z-head first.
	// Its batch forms before its fn runs (and would take deliveries already in the line),
	// so the line forms only once its fn has started.
	started, release := make(chan struct{}), make(chan struct{})
	var startOnce, releaseOnce sync.Once
	free := func() { releaseOnce.Do(func() { close(release) }) }
	defer free() // a failed wait still lets m-first end, and the pool close
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := do(ctx, "m-first", func() { startOnce.Do(func() { close(started) }); <-release }); err != nil {
			t.Errorf("m-first: %v", err)
		}
	})
	waitLine := func(n int) {
		for l.tx.Waiting(scope) < n {
			if ctx.Err() != nil {
				t.Fatalf("%d waiting in the line, want %d", l.tx.Waiting(scope), n)
			}
			time.Sleep(time.Millisecond)
		}
	}
	// The holder's fn runs once it is claimed; the line forms behind it.
	select {
	case <-started:
	case <-ctx.Done():
		t.Fatal("m-first's fn never ran")
	}
	keys := []string{"z-head", "a-1", "a-2", "a-3"}
	for i, key := range keys {
		wg.Go(func() {
			if err := do(ctx, key, nil); err != nil {
				t.Errorf("%s: %v", key, err)
			}
		})
		waitLine(i + 1)
	}
	free()
	wg.Wait()
	mu.Lock()
	if shared < len(keys) {
		t.Fatalf("%d deliveries shared a transaction, want the line's %d in one", shared, len(keys))
	}
	mu.Unlock()
	for _, key := range append(keys, "m-first") {
		dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := do(dctx, key, func() { t.Errorf("%s ran again", key) })
		cancel()
		if err != nil {
			t.Fatalf("%s delivered again: %v (its key was left in flight?)", key, err)
		}
	}
}

// TestDoTxScopeLineStallIsReported: a delivery that waits too long in its scope's line
// (here behind a handler that does not return) is reported once, and keeps waiting: it
// runs when the line moves.
func TestDoTxScopeLineStallIsReported(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	pool := testenv.Postgres(t)
	events := &eventCounts{}
	stalled := events.of(EventLineStalled)
	l := New(pool, &Config{Observe: events.observe})
	defer l.Close()
	l.tx.StallAfter = 100 * time.Millisecond
	entered, release := make(chan struct{}), make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	defer unblock() // before Close, which waits for the blocked handler
	req := func(key string) Request {
		r := batchReq(key)
		r.Scope = "account:stall"
		return r
	}
	first := make(chan error, 1)
	go func() {
		_, err := l.DoTx(ctx, req("stall-1"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			close(entered)
			<-release
			return nil, nil
		})
		first <- err
	}()
	<-entered
	second := make(chan error, 1)
	var ran atomic.Bool
	go func() {
		_, err := l.DoTx(ctx, req("stall-2"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			ran.Store(true)
			return nil, nil
		})
		second <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for stalled.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if stalled.Load() != 1 || ran.Load() {
		t.Fatalf("stalled %d times, second ran %t: want the wait reported once, the delivery still waiting", stalled.Load(), ran.Load())
	}
	unblock()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if err := <-second; err != nil || !ran.Load() {
		t.Fatalf("second: %v, ran %t: want it to run once the line moved", err, ran.Load())
	}
	if stalled.Load() != 1 {
		t.Errorf("stalled %d times, want 1", stalled.Load())
	}
}
