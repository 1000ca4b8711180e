package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/metrics"
	"github.com/idemq/idemq/internal/testenv"
)

// charge is a step's result in these tests.
type charge struct {
	ID     string `json:"id"`
	Amount int    `json:"amount"`
}

// errLater is a retryable handler error: Do ends the lease at once, and the next
// delivery takes the key over in the same generation.
var errLater = errors.New("later")

func TestStepRecordsOnceAndTakeoverGetsItsResult(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	// A lease of an hour: no heartbeat interferes; the test makes the lease lapse itself.
	l, pool := newLedger(t, &idempotency.Config{Lease: time.Hour})
	mustExec(t, pool, `CREATE TABLE effects (key text NOT NULL, who text NOT NULL)`)
	var charges, receipts atomic.Int64
	chargeStep := func(ctx context.Context, stepKey string) (charge, error) {
		n := charges.Add(1)
		return charge{ID: fmt.Sprintf("ch_%d_%s", n, stepKey), Amount: 100}, nil
	}
	tookOver, staleDone := make(chan struct{}), make(chan struct{})
	var second sync.WaitGroup
	var secondRes idempotency.Result
	var secondErr error

	_, err := l.Do(ctx, req("order:1"), func(hctx context.Context) (json.RawMessage, error) {
		c, err := idempotency.Step(hctx, "charge", chargeStep)
		if err != nil {
			return nil, err
		}
		if want := (charge{ID: "ch_1_order:1#s/charge", Amount: 100}); c != want {
			t.Errorf("first run's charge %+v, want %+v", c, want)
		}
		// The lease lapses; a second delivery of the same generation takes the key over.
		mustExec(t, pool, `UPDATE processed_jobs SET locked_until = now() - interval '1 second' WHERE idempotency_key = 'order:1'`)
		second.Go(func() {
			secondRes, secondErr = l.Do(ctx, req("order:1"), func(hctx context.Context) (json.RawMessage, error) {
				c, err := idempotency.Step(hctx, "charge", func(context.Context, string) (charge, error) {
					t.Error("the takeover ran a recorded step")
					return charge{}, nil
				})
				if err != nil {
					return nil, err
				}
				close(tookOver)
				<-staleDone
				_, err = idempotency.StepTx(hctx, "record", func(ctx context.Context, tx pgx.Tx) (int, error) {
					_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ('order:1', 'second')`)
					return 1, err
				})
				if err != nil {
					return nil, err
				}
				return json.Marshal(c)
			})
		})
		<-tookOver
		defer close(staleDone)
		// The stale owner's external step runs (its effect is out of the ledger's hands)
		// but cannot be recorded.
		_, err = idempotency.Step(hctx, "receipt", func(context.Context, string) (string, error) {
			receipts.Add(1)
			return "sent", nil
		})
		if !errors.Is(err, idempotency.ErrLeaseLost) {
			t.Errorf("stale Step: %v, want ErrLeaseLost", err)
		}
		_, err = idempotency.StepTx(hctx, "record", func(ctx context.Context, tx pgx.Tx) (int, error) {
			_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ('order:1', 'stale')`)
			return 1, err
		})
		if !errors.Is(err, idempotency.ErrLeaseLost) {
			t.Errorf("stale StepTx: %v, want ErrLeaseLost", err)
		}
		return json.RawMessage(`"stale"`), nil
	})
	second.Wait()
	if !errors.Is(err, idempotency.ErrLeaseLost) {
		t.Errorf("stale Do: %v, want ErrLeaseLost", err)
	}
	if secondErr != nil {
		t.Fatalf("takeover: %v", secondErr)
	}
	if got, want := string(secondRes.Result), `{"id":"ch_1_order:1#s/charge","amount":100}`; got != want || secondRes.Attempts != 2 {
		t.Errorf("takeover's result %s attempts %d, want %s and 2", got, secondRes.Attempts, want)
	}
	if n := charges.Load(); n != 1 {
		t.Errorf("charge ran %d times, want 1", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects WHERE who = 'stale'`); n != 0 {
		t.Errorf("%d rows of the stale owner's StepTx, want 0 (rolled back)", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 1 {
		t.Errorf("%d effect rows, want 1", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM processed_job_steps WHERE idempotency_key = 'order:1' AND step = 'receipt'`); n != 0 {
		t.Errorf("the stale receipt was recorded")
	}
	r := get(t, l, "order:1")
	if n := count(t, pool, `SELECT count(*) FROM processed_job_steps WHERE idempotency_key = 'order:1' AND step = 'record' AND seq = 1 AND fence = $1`, r.Fence); n != 1 {
		t.Errorf("the takeover's record step is not recorded under its fence %d as the second step call", r.Fence)
	}
}

// TestStepAfterRetry: a delivery after a retryable failure gets the recorded results of
// the steps before the failure, StepTx's included, without running them.
func TestStepAfterRetry(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, nil)
	mustExec(t, pool, `CREATE TABLE effects (key text NOT NULL, n int NOT NULL)`)
	var runs atomic.Int64
	handler := func(ctx context.Context) (json.RawMessage, error) {
		run := runs.Add(1)
		a, err := idempotency.Step(ctx, "a", func(context.Context, string) (int, error) { return int(run) * 10, nil }, idempotency.StepInput(map[string]int{"x": 1}))
		if err != nil {
			return nil, err
		}
		b, err := idempotency.StepTx(ctx, "b", func(ctx context.Context, tx pgx.Tx) (*charge, error) {
			_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ('k', $1)`, run)
			return &charge{ID: "row", Amount: int(run)}, err
		})
		if err != nil {
			return nil, err
		}
		if run == 1 {
			return nil, errLater
		}
		return json.Marshal([]any{a, b})
	}
	if _, err := l.Do(ctx, req("k"), handler); !errors.Is(err, errLater) {
		t.Fatalf("first delivery: %v", err)
	}
	res, err := l.Do(ctx, req("k"), handler)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := string(res.Result), `[10,{"id":"row","amount":1}]`; got != want {
		t.Errorf("second delivery's result %s, want %s (the first's steps)", got, want)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 1 {
		t.Errorf("%d effect rows, want 1", n)
	}
}

// stepReads counts the statements that read a key's recorded steps.
type stepReads struct{ n atomic.Int64 }

func (r *stepReads) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "FROM processed_job_steps s") {
		r.n.Add(1)
	}
	return ctx
}

func (r *stepReads) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestStepReadsOnlyWhenResuming: a job's first delivery has no steps to read and reads
// none; the delivery that resumes it reads them once, however many steps it calls.
func TestStepReadsOnlyWhenResuming(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	reads := &stepReads{}
	cfg.ConnConfig.Tracer = reads
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	l := idempotency.New(pool, nil)
	t.Cleanup(l.Close)
	var runs atomic.Int64
	handler := func(ctx context.Context) (json.RawMessage, error) {
		run := runs.Add(1)
		for _, name := range []string{"a", "b", "c"} {
			if _, err := idempotency.Step(ctx, name, func(context.Context, string) (int64, error) { return run, nil }); err != nil {
				return nil, err
			}
		}
		if run == 1 {
			return nil, errLater
		}
		return json.RawMessage(`true`), nil
	}
	if _, err := l.Do(ctx, req("fresh:1"), handler); !errors.Is(err, errLater) {
		t.Fatalf("first delivery: %v", err)
	}
	if n := reads.n.Load(); n != 0 {
		t.Errorf("the first delivery read the steps %d times, want 0", n)
	}
	if _, err := l.Do(ctx, req("fresh:1"), handler); err != nil {
		t.Fatalf("second delivery: %v", err)
	}
	if n := reads.n.Load(); n != 1 {
		t.Errorf("the resuming delivery read the steps %d times, want 1", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM processed_job_steps WHERE idempotency_key = 'fresh:1' AND result = '1'`); n != 3 {
		t.Errorf("%d steps recorded by the first delivery, want 3", n)
	}
}

func TestStepMismatches(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, _ := newLedger(t, nil)
	noop := func(context.Context, string) (int, error) { return 1, nil }

	// Another input.
	_, err := l.Do(ctx, req("in"), func(ctx context.Context) (json.RawMessage, error) {
		if _, err := idempotency.Step(ctx, "charge", noop, idempotency.StepInput(100)); err != nil {
			return nil, err
		}
		return nil, errLater
	})
	if !errors.Is(err, errLater) {
		t.Fatal(err)
	}
	var stepErr error
	_, err = l.Do(ctx, req("in"), func(ctx context.Context) (json.RawMessage, error) {
		_, stepErr = idempotency.Step(ctx, "charge", func(context.Context, string) (int, error) {
			t.Error("ran a step recorded with another input")
			return 0, nil
		}, idempotency.StepInput(200))
		return nil, stepErr
	})
	var me *idempotency.StepMismatchError
	if !errors.As(stepErr, &me) || me.Step != "charge" || me.Key != "in" || me.Order || !idempotency.IsPermanent(stepErr) {
		t.Fatalf("another input: %v, want a permanent *StepMismatchError for step charge", stepErr)
	}
	if !strings.Contains(stepErr.Error(), `"charge"`) || !errors.Is(err, idempotency.ErrStepMismatch) {
		t.Errorf("error %q (Do: %v): want it to name the step, and Do to return it", stepErr, err)
	}
	if r := get(t, l, "in"); r.Status != idempotency.StatusFailed {
		t.Errorf("a mismatched step left the key %s, want failed", r.Status)
	}

	// Another order.
	_, err = l.Do(ctx, req("order"), func(ctx context.Context) (json.RawMessage, error) {
		for _, name := range []string{"a", "b"} {
			if _, err := idempotency.Step(ctx, name, noop); err != nil {
				return nil, err
			}
		}
		return nil, errLater
	})
	if !errors.Is(err, errLater) {
		t.Fatal(err)
	}
	_, err = l.Do(ctx, req("order"), func(ctx context.Context) (json.RawMessage, error) {
		_, err := idempotency.Step(ctx, "b", noop)
		return nil, err
	})
	if !errors.As(err, &me) || me.Step != "b" || !me.Order || me.Seq != 0 || me.RecordedSeq != 1 {
		t.Fatalf("another order: %v, want a *StepMismatchError for b, recorded #1, called #0", err)
	}

	// One name twice in a run.
	_, err = l.Do(ctx, req("twice"), func(ctx context.Context) (json.RawMessage, error) {
		if _, err := idempotency.Step(ctx, "a", noop); err != nil {
			return nil, err
		}
		_, err := idempotency.StepTx(ctx, "a", func(context.Context, pgx.Tx) (int, error) {
			t.Error("ran a step name twice")
			return 0, nil
		})
		return nil, err
	})
	if !errors.As(err, &me) || me.Step != "a" || !me.Order || me.Seq != 1 || me.RecordedSeq != 0 {
		t.Fatalf("one name twice: %v, want a *StepMismatchError for a", err)
	}
}

func TestStepRefusals(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, nil)
	ran := func(context.Context, string) (int, error) {
		t.Error("a refused step ran")
		return 0, nil
	}
	ranTx := func(context.Context, pgx.Tx) (int, error) {
		t.Error("a refused step ran")
		return 0, nil
	}

	// No claim.
	for _, c := range []context.Context{ctx, idempotency.NewContext(ctx, "k")} {
		if _, err := idempotency.Step(c, "a", ran); !errors.Is(err, idempotency.ErrNoClaim) {
			t.Errorf("Step outside a claim: %v, want ErrNoClaim", err)
		}
		if _, err := idempotency.StepTx(c, "a", ranTx); !errors.Is(err, idempotency.ErrNoClaim) {
			t.Errorf("StepTx outside a claim: %v, want ErrNoClaim", err)
		}
	}

	// Inside DoTx.
	var stepErr, stepTxErr error
	_, err := l.DoTx(ctx, req("tx"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		_, stepErr = idempotency.Step(ctx, "a", ran)
		_, stepTxErr = idempotency.StepTx(ctx, "b", ranTx)
		return nil, nil
	})
	if err != nil || !errors.Is(stepErr, idempotency.ErrStepInTx) || !errors.Is(stepTxErr, idempotency.ErrStepInTx) {
		t.Errorf("inside DoTx: Step %v, StepTx %v (DoTx %v); want ErrStepInTx", stepErr, stepTxErr, err)
	}

	// Names, and a step key too long.
	long := strings.Repeat("k", idempotency.MaxStepJobKeyBytes+1)
	_, err = l.Do(ctx, req(long), func(ctx context.Context) (json.RawMessage, error) {
		for _, name := range []string{"", "Charge", "a b", "a.b", "é", "a#b", strings.Repeat("a", 65)} {
			_, err := idempotency.Step(ctx, name, ran)
			if !errors.Is(err, idempotency.ErrInvalidRequest) || !strings.Contains(err.Error(), "[a-z0-9_-]{1,64}") || !idempotency.IsPermanent(err) {
				t.Errorf("name %q: %v, want a permanent ErrInvalidRequest naming the rule", name, err)
			}
		}
		if _, err := idempotency.Step(ctx, strings.Repeat("a", 64), ran); !errors.Is(err, idempotency.ErrInvalidKey) {
			t.Errorf("a step key over %d bytes: %v, want ErrInvalidKey", idempotency.MaxKeyBytes, err)
		}
		return json.Marshal(must(idempotency.Step(ctx, strings.Repeat("b", 63), func(_ context.Context, key string) (int, error) {
			return len(key), nil
		})))
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, `SELECT count(*) FROM processed_job_steps`); n != 1 {
		t.Errorf("%d step rows, want 1 (the valid name)", n)
	}
	if k, err := idempotency.StepKey("order:1", "charge"); k != "order:1#s/charge" || err != nil {
		t.Errorf("StepKey: %q, %v", k, err)
	}
	// A step inside a StepTx.
	_, err = l.Do(ctx, req("nested"), func(ctx context.Context) (json.RawMessage, error) {
		_, err := idempotency.StepTx(ctx, "outer", func(ctx context.Context, tx pgx.Tx) (int, error) {
			return idempotency.Step(ctx, "inner", ran)
		})
		return nil, err
	})
	if err == nil || !strings.Contains(err.Error(), `step "inner" called inside StepTx "outer"`) || !idempotency.IsPermanent(err) {
		t.Errorf("a step inside a StepTx: %v, want a permanent error naming both", err)
	}
	if n := count(t, pool, `SELECT count(*) FROM processed_job_steps WHERE idempotency_key = 'nested'`); n != 0 {
		t.Errorf("%d steps recorded for a nested step, want 0", n)
	}
	if idempotency.MaxStepJobKeyBytes != 188 {
		t.Errorf("MaxStepJobKeyBytes = %d, want 188", idempotency.MaxStepJobKeyBytes)
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func TestStepRerunAndPurge(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, nil)
	var runs atomic.Int64
	handler := func(ctx context.Context) (json.RawMessage, error) {
		return json.Marshal(must(idempotency.Step(ctx, "charge", func(context.Context, string) (int64, error) {
			return runs.Add(1), nil
		})))
	}
	for _, key := range []string{"old", "new"} {
		if _, err := l.Do(ctx, req(key), handler); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := l.Rerun(ctx, "old"); err != nil {
		t.Fatal(err)
	}
	res, err := l.Do(ctx, req("old"), handler)
	if err != nil || string(res.Result) != "3" || res.Generation != 1 {
		t.Fatalf("after Rerun: %s generation %d, %v; want the step run again (3) in generation 1", res.Result, res.Generation, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM processed_job_steps WHERE idempotency_key = 'old' AND generation = 0`); n != 0 {
		t.Errorf("generation 0 keeps %d step rows after the rerun, want 0", n)
	}

	mustExec(t, pool, `UPDATE processed_jobs SET completed_at = now() - interval '2 hours', started_at = now() - interval '2 hours' WHERE idempotency_key = 'old'`)
	if n, err := l.Purge(ctx, time.Hour, 0); err != nil || n != 1 {
		t.Fatalf("Purge: %d, %v; want 1", n, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM processed_job_steps WHERE idempotency_key = 'old'`); n != 0 {
		t.Errorf("%d step rows of a purged key, want 0", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM processed_job_steps WHERE idempotency_key = 'new'`); n != 1 {
		t.Errorf("%d step rows of a key not purged, want 1", n)
	}
}

// TestStepTxRacesATakeover: an operator's release (which fences the holder out, as a
// takeover does) lands while a StepTx holds the job's row (the release waits for it, and
// the next delivery gets the StepTx's recorded result), before it (the StepTx writes
// nothing), or at a random moment. Never both.
func TestStepTxRacesATakeover(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 2*time.Minute)
	l, pool := newLedger(t, &idempotency.Config{Lease: time.Hour})
	mustExec(t, pool, `CREATE TABLE effects (key text NOT NULL, who text NOT NULL)`)
	const keys = 60
	const (
		during = iota // the release is sent while the StepTx holds the row
		before        // the release commits before the StepTx begins
		random        // the release is sent at a random moment
	)
	var committed [3]atomic.Int64
	var wg sync.WaitGroup
	for i := range keys {
		key, mode := fmt.Sprintf("race:%d", i), i%3
		wg.Go(func() {
			send, released := make(chan struct{}), make(chan struct{})
			go func() {
				defer close(released)
				<-send
				if mode == random {
					time.Sleep(time.Duration(rand.IntN(20000)) * time.Microsecond)
				}
				if err := l.Release(ctx, key); err != nil && !errors.Is(err, idempotency.ErrNotInProgress) {
					t.Errorf("release %s: %v", key, err)
				}
			}()
			_, err := l.Do(ctx, req(key), func(ctx context.Context) (json.RawMessage, error) {
				if mode != during {
					close(send)
				}
				if mode == before {
					<-released
				}
				_, err := idempotency.StepTx(ctx, "record", func(ctx context.Context, tx pgx.Tx) (string, error) {
					if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, 'first')`, key); err != nil {
						return "", err
					}
					if mode == during {
						close(send)
						time.Sleep(20 * time.Millisecond) // the release waits for the row
					} else {
						time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
					}
					return "first", nil
				})
				if err == nil {
					committed[mode].Add(1)
				} else if !errors.Is(err, idempotency.ErrLeaseLost) {
					t.Errorf("%s: StepTx: %v, want success or ErrLeaseLost", key, err)
				}
				return nil, err
			})
			<-released
			if err != nil && !errors.Is(err, idempotency.ErrLeaseLost) {
				t.Errorf("%s: first delivery: %v", key, err)
			}
			for {
				_, err = l.Do(ctx, req(key), func(ctx context.Context) (json.RawMessage, error) {
					s, err := idempotency.StepTx(ctx, "record", func(ctx context.Context, tx pgx.Tx) (string, error) {
						_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, 'second')`, key)
						return "second", err
					})
					if err != nil {
						return nil, err
					}
					return json.Marshal(s)
				})
				if !waitBusy(err) {
					break
				}
			}
			if err != nil {
				t.Errorf("%s: second delivery: %v", key, err)
			}
		})
	}
	wg.Wait()
	if n := count(t, pool, `SELECT count(*) FROM (SELECT key FROM effects GROUP BY key HAVING count(*) <> 1) x`); n != 0 {
		t.Errorf("%d keys without exactly one effect", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != keys {
		t.Errorf("%d effects, want %d", n, keys)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects e JOIN processed_job_steps s ON s.idempotency_key = e.key AND s.result = to_jsonb(e.who)`); n != keys {
		t.Errorf("%d effects match their step's record, want %d", n, keys)
	}
	if got, want := committed[during].Load(), int64(keys/3); got != want {
		t.Errorf("%d StepTx committed while a release waited for them, want %d", got, want)
	}
	if got := committed[before].Load(); got != 0 {
		t.Errorf("%d StepTx committed after a release, want 0", got)
	}
	t.Logf("at random moments, %d of %d StepTx committed before the release", committed[random].Load(), keys/3)
}

// TestStepUnfenced is the negative control: without fencing (Config.UnsafeNoFencing) a
// stale owner records its steps, over the new owner's.
func TestStepUnfenced(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, &idempotency.Config{Lease: time.Hour, UnsafeNoFencing: true})
	step := func(result string) func(context.Context, string) (string, error) {
		return func(context.Context, string) (string, error) { return result, nil }
	}
	tookOver, staleDone := make(chan struct{}), make(chan struct{})
	var second sync.WaitGroup
	var secondErr error
	_, err := l.Do(ctx, req("k"), func(hctx context.Context) (json.RawMessage, error) {
		if _, err := idempotency.Step(hctx, "a", step("stale-a")); err != nil {
			return nil, err
		}
		mustExec(t, pool, `UPDATE processed_jobs SET locked_until = now() - interval '1 second' WHERE idempotency_key = 'k'`)
		second.Go(func() {
			_, secondErr = l.Do(ctx, req("k"), func(hctx context.Context) (json.RawMessage, error) {
				for _, name := range []string{"a", "b"} {
					if _, err := idempotency.Step(hctx, name, step("new-"+name)); err != nil {
						return nil, err
					}
				}
				close(tookOver)
				<-staleDone
				return nil, nil
			})
		})
		<-tookOver
		defer close(staleDone)
		if _, err := idempotency.Step(hctx, "b", step("stale-b")); err != nil {
			t.Errorf("unfenced stale Step: %v, want it recorded", err)
		}
		if _, err := idempotency.StepTx(hctx, "c", func(context.Context, pgx.Tx) (string, error) { return "stale-c", nil }); err != nil {
			t.Errorf("unfenced stale StepTx: %v, want it recorded", err)
		}
		return nil, nil
	})
	second.Wait()
	// Nothing fenced the stale owner out: whichever completion comes second finds the key
	// no longer in progress.
	for _, err := range []error{err, secondErr} {
		if err != nil && !errors.Is(err, idempotency.ErrLeaseLost) {
			t.Fatalf("unfenced delivery: %v", err)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM processed_job_steps WHERE result IN ('"stale-b"', '"stale-c"')`); n != 2 {
		t.Errorf("%d of the stale owner's steps recorded, want 2 (nothing fenced)", n)
	}
}

// TestStepsShowsTheCurrentGeneration: Ledger.Steps lists the steps of the key's current
// generation in the order the run called them, and nothing for a key the ledger lacks.
func TestStepsShowsTheCurrentGeneration(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, nil)
	res, err := l.Do(ctx, req("show:1"), func(ctx context.Context) (json.RawMessage, error) {
		if _, err := idempotency.Step(ctx, "charge", func(context.Context, string) (charge, error) {
			return charge{ID: "ch_1", Amount: 100}, nil
		}, idempotency.StepInput(100)); err != nil {
			return nil, err
		}
		if _, err := idempotency.StepTx(ctx, "record", func(context.Context, pgx.Tx) (int, error) { return 7, nil }); err != nil {
			return nil, err
		}
		return json.RawMessage(`"done"`), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// A row of another generation (as a rerun leaves none, written by hand) is not shown.
	mustExec(t, pool, `INSERT INTO processed_job_steps (idempotency_key, generation, step, seq, fence) VALUES ('show:1', 9, 'stray', 0, 1)`)

	steps, err := l.Steps(ctx, "show:1")
	if err != nil {
		t.Fatal(err)
	}
	if len(steps) != 2 {
		t.Fatalf("Steps: %+v, want charge and record", steps)
	}
	for i, want := range []struct {
		name, result string
		input        bool
	}{{"charge", `{"id": "ch_1", "amount": 100}`, true}, {"record", "7", false}} {
		s := steps[i]
		if s.Name != want.name || s.Seq != i || s.Fence != res.Fence || string(s.Result) != want.result ||
			(s.InputFingerprint != nil) != want.input || s.CreatedAt.IsZero() {
			t.Errorf("step %d: %+v, want %s seq %d fence %d result %s input %v and a time", i, s, want.name, i, res.Fence, want.result, want.input)
		}
	}

	for _, key := range []string{"show:none", "show:2"} {
		if key == "show:2" {
			if _, err := l.Do(ctx, req(key), func(context.Context) (json.RawMessage, error) { return json.RawMessage(`1`), nil }); err != nil {
				t.Fatal(err)
			}
		}
		if steps, err := l.Steps(ctx, key); err != nil || len(steps) != 0 {
			t.Errorf("Steps(%s): %+v, %v; want none", key, steps, err)
		}
	}
}

// TestStepOutcomesAreCounted: every Step and StepTx call is reported once to
// Config.ObserveStep, here the worker's idemq_steps_total, with its task type, name and
// outcome: ran, cached (a later delivery), error (fn failed), lease_lost (a newer claim
// holds the key) and mismatch (another input). A call refused for its bad name is not.
func TestStepOutcomesAreCounted(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	m := metrics.New()
	l, pool := newLedger(t, &idempotency.Config{Lease: time.Hour, ObserveStep: func(taskType, step string, o idempotency.StepOutcome) {
		m.ObserveStep(taskType, step, string(o))
	}})
	mustExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)
	errDown := errors.New("provider down")
	noop := func(context.Context, string) (int, error) { return 1, nil }
	record := func(ctx context.Context, tx pgx.Tx) (int, error) {
		_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ('k')`)
		return 1, err
	}
	// Three steps, the last failing on the first delivery and running on the second.
	var deliveries atomic.Int64
	handler := func(ctx context.Context) (json.RawMessage, error) {
		n := deliveries.Add(1)
		if _, err := idempotency.Step(ctx, "charge", noop); err != nil {
			return nil, err
		}
		if _, err := idempotency.StepTx(ctx, "record", record); err != nil {
			return nil, err
		}
		_, err := idempotency.Step(ctx, "receipt", func(context.Context, string) (int, error) {
			if n == 1 {
				return 0, errDown
			}
			return 1, nil
		})
		return nil, err
	}
	if _, err := l.Do(ctx, req("k"), handler); !errors.Is(err, errDown) {
		t.Fatalf("first delivery: %v, want %v", err, errDown)
	}
	if _, err := l.Do(ctx, req("k"), handler); err != nil {
		t.Fatalf("second delivery: %v", err)
	}
	// A newer claim (here: another fence) holds the key: neither step is recorded.
	_, err := l.Do(ctx, req("lost"), func(ctx context.Context) (json.RawMessage, error) {
		mustExec(t, pool, `UPDATE processed_jobs SET fence = fence + 1000 WHERE idempotency_key = 'lost'`)
		_, err := idempotency.Step(ctx, "charge", noop)
		if !errors.Is(err, idempotency.ErrLeaseLost) {
			t.Errorf("Step after a takeover: %v, want ErrLeaseLost", err)
		}
		_, err = idempotency.StepTx(ctx, "record", record)
		if !errors.Is(err, idempotency.ErrLeaseLost) {
			t.Errorf("StepTx after a takeover: %v, want ErrLeaseLost", err)
		}
		_, err = idempotency.Step(ctx, "Bad Name", noop)
		return nil, err
	})
	if !errors.Is(err, idempotency.ErrInvalidRequest) {
		t.Fatalf("lost delivery: %v, want ErrInvalidRequest", err)
	}
	// Another input on the second delivery.
	for i, want := range []error{errLater, idempotency.ErrStepMismatch} {
		_, err := l.Do(ctx, req("mm"), func(ctx context.Context) (json.RawMessage, error) {
			if _, err := idempotency.Step(ctx, "charge", noop, idempotency.StepInput(i)); err != nil {
				return nil, err
			}
			return nil, errLater
		})
		if !errors.Is(err, want) {
			t.Fatalf("delivery %d of mm: %v, want %v", i+1, err, want)
		}
	}

	srv := httptest.NewServer(m.Handler(nil, nil))
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var got []string
	for _, line := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(line, "idemq_steps_total{") {
			got = append(got, line)
		}
	}
	series := func(step, outcome string, n int) string {
		return fmt.Sprintf(`idemq_steps_total{outcome=%q,step=%q,task_type="test:task"} %d`, outcome, step, n)
	}
	want := []string{
		series("charge", "cached", 1),
		series("charge", "lease_lost", 1),
		series("charge", "mismatch", 1),
		series("charge", "ran", 2),
		series("receipt", "error", 1),
		series("receipt", "mismatch", 0), // a step's mismatch series starts at zero (its alert's increase())
		series("receipt", "ran", 1),
		series("record", "cached", 1),
		series("record", "lease_lost", 1),
		series("record", "mismatch", 0),
		series("record", "ran", 1),
	}
	slices.Sort(got)
	slices.Sort(want)
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("idemq_steps_total:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 1 {
		t.Errorf("%d effect rows, want 1", n)
	}
}

// TestStepRecordOutlastsAPostgresRestart: Postgres stops right after a step's effect and
// comes back 1.5 s later, inside the lease: the step's record is tried again until it
// lands, so the next step and the completion follow and the effect is not repeated.
func TestStepRecordOutlastsAPostgresRestart(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	ctx := testenv.Context(t, 2*time.Minute)
	if err := testenv.Migrate(ctx, pg.URL); err != nil {
		t.Fatal(err)
	}
	pool := testenv.Pool(t, pg.URL)
	l := idempotency.New(pool, &idempotency.Config{Lease: 20 * time.Second, HeartbeatPool: pool})
	t.Cleanup(l.Close)
	var effects atomic.Int64
	restarted := make(chan error, 1)
	res, err := l.Do(ctx, req("outage:1"), func(ctx context.Context) (json.RawMessage, error) {
		sent, err := idempotency.Step(ctx, "send", func(context.Context, string) (int64, error) {
			n := effects.Add(1)
			if err := pg.StopImmediate(); err != nil {
				return 0, err
			}
			go func() { time.Sleep(1500 * time.Millisecond); restarted <- pg.Start() }()
			return n, nil
		})
		if err != nil {
			return nil, err
		}
		return json.Marshal(sent)
	})
	if err := <-restarted; err != nil {
		t.Fatal(err)
	}
	if err != nil {
		t.Fatalf("Do across the restart: %v, want the step recorded once Postgres was back", err)
	}
	if n := effects.Load(); n != 1 || string(res.Result) != "1" {
		t.Fatalf("effect ran %d times, result %s; want once, 1", n, res.Result)
	}
	r := get(t, l, "outage:1")
	if n := count(t, pool, `SELECT count(*) FROM processed_job_steps WHERE idempotency_key = 'outage:1' AND step = 'send' AND fence = $1`, r.Fence); n != 1 {
		t.Errorf("the step is not recorded under the claim's fence %d", r.Fence)
	}
}

// TestStepTxHoldsTheJobsRow: while a StepTx runs, no other transaction can update the
// job's row (a takeover's claim, a release, another worker's heartbeat): an update with a
// short lock_timeout gives up on the row lock, and one without waits until the StepTx
// ends. A plain read of the fence would let the update through.
func TestStepTxHoldsTheJobsRow(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, &idempotency.Config{Lease: time.Hour})
	entered, proceed := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := l.Do(ctx, req("held:1"), func(ctx context.Context) (json.RawMessage, error) {
			_, err := idempotency.StepTx(ctx, "record", func(ctx context.Context, tx pgx.Tx) (int, error) {
				close(entered)
				<-proceed
				return 1, nil
			})
			return nil, err
		})
		done <- err
	}()
	<-entered
	var once sync.Once
	release := func() { once.Do(func() { close(proceed) }) }
	defer release() // a failing check must not leave the StepTx waiting
	update := func(timeout string) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, timeout); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `UPDATE processed_jobs SET locked_until = now() - interval '1 second' WHERE idempotency_key = 'held:1'`)
			return err
		})
	}
	if err := update("200ms"); !idempotency.IsLockTimeout(err) {
		t.Fatalf("an update of the job's row during its StepTx: %v, want a lock timeout", err)
	}
	waited := make(chan error, 1)
	go func() { waited <- update("0") }()
	select {
	case err := <-waited:
		t.Fatalf("an update without a lock timeout finished during the StepTx: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	release()
	if err := <-waited; err != nil {
		t.Fatalf("the waiting update, once the StepTx ended: %v", err)
	}
	if err := <-done; err != nil && !errors.Is(err, idempotency.ErrLeaseLost) {
		t.Fatalf("Do: %v", err)
	}
	if n := count(t, pool, `SELECT count(*) FROM processed_job_steps WHERE idempotency_key = 'held:1'`); n != 1 {
		t.Errorf("%d step rows, want 1: the StepTx committed before the update went through", n)
	}
}
