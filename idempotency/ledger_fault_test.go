package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// privateLedger starts a private Postgres, migrates it, and returns a ledger on it.
func privateLedger(t *testing.T, cfg *idempotency.Config) (*testenv.PrivatePostgres, *idempotency.Ledger, *pgxpool.Pool) {
	t.Helper()
	pg := testenv.StartPostgres(t)
	ctx := testenv.Context(t, time.Minute)
	if err := testenv.Migrate(ctx, pg.URL); err != nil {
		t.Fatal(err)
	}
	pool := testenv.Pool(t, pg.URL)
	l := idempotency.New(pool, cfg)
	t.Cleanup(l.Close)
	return pg, l, pool
}

// TestUnreachableDatabaseSelfFences: when heartbeats cannot reach Postgres (stopped or
// paused), the handler is cancelled by the self-fence deadline.
func TestUnreachableDatabaseSelfFences(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"stop", "pause"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			const lease, margin = time.Second, 200 * time.Millisecond
			ev := &events{}
			pg, l, _ := privateLedger(t, &idempotency.Config{Lease: lease, SelfFenceMargin: margin, Observe: ev.observe})
			ctx := testenv.Context(t, 2*time.Minute)
			var claimedAt time.Time
			var waited time.Duration
			var cause error
			_, err := l.Do(ctx, req("k"), func(fctx context.Context) (json.RawMessage, error) {
				claimedAt = time.Now() // a little after the claim was sent
				var err error
				if how == "stop" {
					// Stop sends SIGTERM, a smart shutdown that waits for our idle
					// connections; an immediate shutdown stops at once.
					err = pg.StopImmediate()
				} else {
					err = pg.Pause()
				}
				if err != nil {
					t.Error(err)
				}
				select {
				case <-fctx.Done():
				case <-time.After(30 * time.Second):
				}
				waited, cause = time.Since(claimedAt), context.Cause(fctx)
				if how == "stop" {
					err = pg.Start()
				} else {
					err = pg.Resume()
				}
				if err != nil {
					t.Error(err)
				}
				return nil, fctx.Err() // what handlers return: context.Canceled
			})
			if !errors.Is(cause, idempotency.ErrLeaseLost) {
				t.Fatalf("handler's cause %v, want ErrLeaseLost", cause)
			}
			// Do says the lease was lost, whatever the handler returned.
			if !errors.Is(err, idempotency.ErrLeaseLost) || !errors.Is(err, context.Canceled) {
				t.Fatalf("Do: %v, want the handler's context.Canceled and ErrLeaseLost", err)
			}
			// Cancelled by claim send time + lease - margin; never after the lease.
			if waited > lease-margin+100*time.Millisecond || waited < lease/3 {
				t.Fatalf("handler cancelled %s after its claim; want by %s (lease %s - margin %s)", waited, lease-margin, lease, margin)
			}
			if ev.get(idempotency.EventSelfFenced) != 1 {
				t.Fatalf("self_fenced events = %d, want 1", ev.get(idempotency.EventSelfFenced))
			}
			t.Logf("cancelled %s after the claim; Do: %v", waited, err)
		})
	}
}

// TestFrozenWorkerCannotComplete: a worker frozen past its lease, with Postgres out of
// reach, is taken over; its late completion is refused and the new owner's result stays.
func TestFrozenWorkerCannotComplete(t *testing.T) {
	t.Parallel()
	const lease = 300 * time.Millisecond
	pg, l, pool := privateLedger(t, &idempotency.Config{Lease: lease})
	ctx := testenv.Context(t, 2*time.Minute)
	taken := make(chan struct{})
	var wg sync.WaitGroup
	var doErr error
	wg.Go(func() {
		_, doErr = l.Do(ctx, req("frozen"), func(fctx context.Context) (json.RawMessage, error) {
			if err := pg.Pause(); err != nil {
				t.Error(err)
			}
			time.Sleep(3 * lease) // frozen: heartbeats cannot get through
			if err := pg.Resume(); err != nil {
				t.Error(err)
			}
			<-taken // still frozen while another worker takes over
			return json.RawMessage(`"stale"`), nil
		})
	})
	// A second worker takes the key over once the lease has expired.
	var second idempotency.Result
	deadline := time.Now().Add(30 * time.Second)
	for {
		time.Sleep(50 * time.Millisecond)
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		res, err := l.Do(cctx, req("frozen"), func(ctx context.Context) (json.RawMessage, error) { return json.RawMessage(`"fresh"`), nil })
		cancel()
		if err == nil {
			second = res
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no takeover: %v", err)
		}
	}
	close(taken)
	wg.Wait()
	if !errors.Is(doErr, idempotency.ErrLeaseLost) {
		t.Fatalf("frozen worker's Do: %v, want ErrLeaseLost", doErr)
	}
	var result string
	if err := pool.QueryRow(ctx, `SELECT result #>> '{}' FROM processed_jobs WHERE idempotency_key = 'frozen'`).Scan(&result); err != nil {
		t.Fatal(err)
	}
	if result != "fresh" || second.Attempts != 2 {
		t.Fatalf("stored result %q, second attempts %d: want the second worker's, attempt 2", result, second.Attempts)
	}
}

// TestImmediateStopMidDoTx stops Postgres with an immediate shutdown while DoTx calls
// run, then restarts it: no effect without a completion, no completion without an effect,
// and every DoTx that returned success is completed.
func TestImmediateStopMidDoTx(t *testing.T) {
	t.Parallel()
	ev := &events{}
	pg, l, pool := privateLedger(t, &idempotency.Config{WriteTimeout: 5 * time.Second, Observe: ev.observe})
	ctx := testenv.Context(t, 3*time.Minute)
	mustExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)
	var mu sync.Mutex
	succeeded := map[string]bool{}
	var unknown int
	for round := range 4 {
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for w := range 6 {
			wg.Go(func() {
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					key := fmt.Sprintf("r%d-w%d-%d", round, w, i)
					cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
					_, err := l.DoTx(cctx, req(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
						_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key)
						return json.RawMessage(`{"ok":true}`), err
					})
					cancel()
					mu.Lock()
					if err == nil {
						succeeded[key] = true
					} else if errors.Is(err, idempotency.ErrCommitUnknown) {
						unknown++
						t.Logf("%s: %v", key, err)
					}
					mu.Unlock()
					if err != nil {
						time.Sleep(20 * time.Millisecond)
					}
				}
			})
		}
		time.Sleep(time.Duration(50+rand.IntN(150)) * time.Millisecond)
		if err := pg.StopImmediate(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
		if err := pg.Start(); err != nil {
			t.Fatal(err)
		}
		pool.Reset()
		close(stop)
		wg.Wait()
	}
	pool.Reset()
	var bad []string
	rows, err := pool.Query(ctx, `
		SELECT coalesce(p.idempotency_key, e.key), coalesce(p.status, '(none)'), coalesce(e.n, 0)
		FROM processed_jobs p FULL JOIN (SELECT key, count(*) AS n FROM effects GROUP BY key) e ON e.key = p.idempotency_key
		WHERE p.status IS DISTINCT FROM 'completed' OR e.n IS DISTINCT FROM 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var key, status string
		var n int
		if err := rows.Scan(&key, &status, &n); err != nil {
			t.Fatal(err)
		}
		bad = append(bad, fmt.Sprintf("%s: status %s, %d effects", key, status, n))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(bad) > 0 {
		t.Fatalf("effects and completions disagree:\n%v", bad)
	}
	for key := range succeeded {
		if r := get(t, l, key); r.Status != idempotency.StatusCompleted {
			t.Fatalf("%s returned success but is %s", key, r.Status)
		}
	}
	n := count(t, pool, `SELECT count(*) FROM processed_jobs`)
	t.Logf("%d completed keys, %d reported success, %d unknown outcomes, %d resolved by transaction id",
		n, len(succeeded), unknown, ev.get(idempotency.EventCommitResolved))
	if got := ev.get(idempotency.EventCommitUnknown); got != unknown {
		t.Errorf("commit_unknown observed %d times, want %d (the DoTx calls that returned ErrCommitUnknown)", got, unknown)
	}
	if len(succeeded) == 0 {
		t.Fatal("no DoTx succeeded")
	}
}
