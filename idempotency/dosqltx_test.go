package idempotency_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// sqlLedger is a ledger whose Config.SQL is a database/sql pool (pgx's stdlib) over the
// same schema as its pgx pool.
func sqlLedger(t *testing.T, cfg *idempotency.Config) (*idempotency.Ledger, *sql.DB) {
	t.Helper()
	pool := testenv.Postgres(t)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { db.Close() })
	if cfg == nil {
		cfg = &idempotency.Config{}
	}
	cfg.SQL = db
	l := idempotency.New(pool, cfg)
	t.Cleanup(l.Close)
	mustExec(t, pool, `CREATE TABLE effects (key text NOT NULL, worker int NOT NULL DEFAULT 0)`)
	return l, db
}

func sqlCount(t *testing.T, db *sql.DB, query string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(query).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Many concurrent deliveries of one key through database/sql: one effect, one answer, and
// the row and effect commit together.
func TestDoSQLTxManyWorkersOneEffect(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 2*time.Minute)
	ev := &events{}
	l, db := sqlLedger(t, &idempotency.Config{Observe: ev.observe})
	const workers = 32
	results := make([]string, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for {
				res, err := l.DoSQLTx(ctx, req("debit:1"), func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
					if _, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ('debit:1', $1)`, w); err != nil {
						return nil, err
					}
					time.Sleep(2 * time.Millisecond) // widen the window
					return json.RawMessage(fmt.Sprintf(`{"worker":%d}`, w)), nil
				})
				if waitBusy(err) {
					continue
				}
				if err != nil {
					t.Errorf("worker %d: %v", w, err)
					return
				}
				results[w] = string(res.Result)
				return
			}
		})
	}
	wg.Wait()
	if n := sqlCount(t, db, `SELECT count(*) FROM effects`); n != 1 {
		t.Fatalf("effects = %d, want 1", n)
	}
	for w := range workers {
		if !jsonEqual(json.RawMessage(results[w]), json.RawMessage(results[0])) {
			t.Fatalf("worker %d got %s, worker 0 got %s: want one answer", w, results[w], results[0])
		}
	}
	if r := get(t, l, "debit:1"); r.Status != idempotency.StatusCompleted || r.Attempts != 1 || !jsonEqual(r.Result, json.RawMessage(results[0])) {
		t.Fatalf("row %+v: want completed at attempt 1 with the answer", r)
	}
	if got := ev.get(idempotency.EventClaimed); got != 1 {
		t.Errorf("claimed events = %d, want 1", got)
	}
	if got := ev.get(idempotency.EventCompleted); got != 1 {
		t.Errorf("completed events = %d, want 1", got)
	}
}

// An error rolls the effect back and leaves no row; a panic too, and panics again; a
// permanent error records the key failed; the fence is in fn's ctx; a result jsonb
// refuses is recorded as failed; a handler that ends tx itself is told so.
func TestDoSQLTxFailures(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, db := sqlLedger(t, nil)
	insert := func(ctx context.Context, tx *sql.Tx, key string) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO effects (key) VALUES ($1)`, key)
		return err
	}
	var fences []int64
	for i := range 3 {
		res, err := l.DoSQLTx(ctx, req("e"), func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
			key, fence, ok := idempotency.FromContext(ctx)
			if !ok || key != "e" {
				t.Errorf("FromContext: %q, %v", key, ok)
			}
			fences = append(fences, fence)
			if err := insert(ctx, tx, "e"); err != nil {
				return nil, err
			}
			if i < 2 {
				return nil, errors.New("boom")
			}
			return json.RawMessage(`{"n":1}`), nil
		})
		switch {
		case i < 2 && (err == nil || err.Error() != "boom"):
			t.Fatalf("run %d: %v, want boom", i, err)
		case i < 2:
			if n := sqlCount(t, db, `SELECT count(*) FROM effects`); n != 0 {
				t.Fatalf("effects after a failed run = %d", n)
			}
			if _, err := l.Get(ctx, "e"); !errors.Is(err, idempotency.ErrNotFound) {
				t.Fatalf("ledger row after a rolled back claim: %v, want ErrNotFound", err)
			}
		case err != nil || res.Cached || !jsonEqual(res.Result, json.RawMessage(`{"n":1}`)) || res.Fence != fences[2]:
			t.Fatalf("run %d: %+v, %v", i, res, err)
		}
	}
	if fences[0] >= fences[1] || fences[1] >= fences[2] {
		t.Fatalf("fences %v: a rolled back claim's fence was reused", fences)
	}
	res, err := l.DoSQLTx(ctx, req("e"), func(context.Context, *sql.Tx) (json.RawMessage, error) {
		t.Error("a completed key's handler ran")
		return nil, nil
	})
	if err != nil || !res.Cached || !jsonEqual(res.Result, json.RawMessage(`{"n":1}`)) {
		t.Fatalf("duplicate: %+v, %v; want the cached result", res, err)
	}

	func() {
		defer func() {
			if p := recover(); p != "oops" {
				t.Fatalf("recovered %v, want oops", p)
			}
		}()
		l.DoSQLTx(ctx, req("panic"), func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
			_ = insert(ctx, tx, "panic")
			panic("oops")
		})
	}()
	if n := sqlCount(t, db, `SELECT count(*) FROM effects WHERE key = 'panic'`); n != 0 {
		t.Fatal("the effect of a panicking handler committed")
	}
	if _, err := l.Get(ctx, "panic"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("ledger row after a panic: %v", err)
	}

	if _, err := l.DoSQLTx(ctx, req("declined"), func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
		if err := insert(ctx, tx, "declined"); err != nil {
			return nil, err
		}
		return nil, idempotency.Permanent(errors.New("declined"))
	}); !idempotency.IsPermanent(err) {
		t.Fatalf("DoSQLTx: %v, want the permanent error", err)
	}
	if r := get(t, l, "declined"); r.Status != idempotency.StatusFailed || r.LastError != "declined" || r.Attempts != 1 {
		t.Fatalf("row %+v: want failed at attempt 1", r)
	}
	if n := sqlCount(t, db, `SELECT count(*) FROM effects WHERE key = 'declined'`); n != 0 {
		t.Fatal("the effect of a permanently failed handler committed")
	}

	_, err = l.DoSQLTx(ctx, req("refused"), func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
		return json.RawMessage(`1e1000000`), insert(ctx, tx, "refused") // valid JSON that jsonb refuses
	})
	if r := get(t, l, "refused"); err == nil || r.Status != idempotency.StatusFailed || !strings.Contains(r.LastError, "refused by the database") {
		t.Fatalf("a result jsonb refuses: %v, row %+v; want an error and the key failed", err, r)
	}
	if n := sqlCount(t, db, `SELECT count(*) FROM effects WHERE key = 'refused'`); n != 0 {
		t.Fatal("the effect of a refused result committed")
	}

	_, err = l.DoSQLTx(ctx, req("rolls-back"), func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
		return nil, tx.Rollback()
	})
	if err == nil || !strings.Contains(err.Error(), "ended the transaction") {
		t.Fatalf("a handler that rolled tx back: %v, want it told", err)
	}
	if _, err := l.Get(ctx, "rolls-back"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("ledger row after the handler rolled back: %v", err)
	}
}

// A key another transaction holds waits for it, up to ClaimLockTimeout, then is busy;
// a key in progress under another owner's live lease is busy without running fn.
func TestDoSQLTxBusy(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, _ := sqlLedger(t, &idempotency.Config{ClaimLockTimeout: 200 * time.Millisecond, Lease: 30 * time.Second})
	claim, err := l.Claim(ctx, req("leased"))
	if err != nil || claim.Claim == nil {
		t.Fatalf("Claim: %+v, %v", claim, err)
	}
	_, err = l.DoSQLTx(ctx, req("leased"), func(context.Context, *sql.Tx) (json.RawMessage, error) {
		t.Error("fn ran on a key under a live lease")
		return nil, nil
	})
	if !errors.Is(err, idempotency.ErrBusy) {
		t.Fatalf("DoSQLTx on a leased key: %v, want ErrBusy", err)
	}

	entered, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := l.DoSQLTx(ctx, req("held"), func(context.Context, *sql.Tx) (json.RawMessage, error) {
			close(entered)
			<-release
			return json.RawMessage(`"first"`), nil
		})
		done <- err
	}()
	<-entered
	_, err = l.DoSQLTx(ctx, req("held"), func(context.Context, *sql.Tx) (json.RawMessage, error) {
		t.Error("fn ran on a key another transaction holds")
		return nil, nil
	})
	if !errors.Is(err, idempotency.ErrBusy) {
		t.Fatalf("DoSQLTx on a held key: %v, want ErrBusy", err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	res, err := l.DoSQLTx(ctx, req("held"), func(context.Context, *sql.Tx) (json.RawMessage, error) {
		t.Error("fn ran on a completed key")
		return nil, nil
	})
	if err != nil || !res.Cached || !jsonEqual(res.Result, json.RawMessage(`"first"`)) {
		t.Fatalf("after the holder: %+v, %v", res, err)
	}
}

// A ledger without Config.SQL runs DoSQLTx on a *sql.DB over its own pool; one with a
// driver that is neither pgx's stdlib nor lib/pq refuses DoSQLTx and says why; a
// vouched-for wrapper is taken at its word.
func TestDoSQLTxRefusesOtherDrivers(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	pool := testenv.Postgres(t)
	mustExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)
	fn := func(context.Context, *sql.Tx) (json.RawMessage, error) {
		t.Error("fn ran")
		return nil, nil
	}
	l := idempotency.New(pool, nil)
	defer l.Close()
	res, err := l.DoSQLTx(ctx, req("own-pool"), func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
		_, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ('own-pool')`)
		return json.RawMessage(`"ok"`), err
	})
	if err != nil || !jsonEqual(res.Result, json.RawMessage(`"ok"`)) || count(t, pool, `SELECT count(*) FROM effects`) != 1 {
		t.Fatalf("without Config.SQL: %+v, %v; want it run on the ledger's pool", res, err)
	}
	other := testenv.OtherSQLDB(t)
	l2 := idempotency.New(pool, &idempotency.Config{SQL: other})
	defer l2.Close()
	_, err = l2.DoSQLTx(ctx, req("k"), fn)
	if err == nil || !strings.Contains(err.Error(), "testenv.OtherDriver") || !strings.Contains(err.Error(), "lib/pq") || !strings.Contains(err.Error(), "pgx/v5/stdlib") {
		t.Fatalf("another driver: %v, want its type and the two supported named", err)
	}
	l3 := idempotency.New(pool, &idempotency.Config{SQL: other, SQLDriver: "mysql"})
	defer l3.Close()
	if err := l3.CheckSQL(); err == nil || !strings.Contains(err.Error(), `"mysql"`) {
		t.Fatalf("SQLDriver mysql: %v", err)
	}
	l4 := idempotency.New(pool, &idempotency.Config{SQL: other, SQLDriver: "pgx"})
	defer l4.Close()
	if err := l4.CheckSQL(); err != nil {
		t.Fatalf("a vouched-for wrapper: %v", err)
	}
}
