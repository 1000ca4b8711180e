package examples_test

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

	_ "github.com/lib/pq" // the "postgres" driver

	"github.com/idemq/idemq/examples/internal/exampletest"
	"github.com/idemq/idemq/examples/internal/posting"
	"github.com/idemq/idemq/idempotency"
)

// pqLedger is a ledger whose DoSQLTx transactions are lib/pq's, on the test's schema.
func pqLedger(t *testing.T, cfg idempotency.Config) (*idempotency.Ledger, *sql.DB) {
	t.Helper()
	pool, dsn := exampletest.Postgres(t)
	db, err := sql.Open("postgres", dsn) // search_path=<schema> is sent as a run-time parameter
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	cfg.SQL = db
	l := idempotency.New(pool, &cfg)
	t.Cleanup(l.Close)
	if err := l.CheckSQL(); err != nil {
		t.Fatalf("CheckSQL on lib/pq: %v", err)
	}
	return l, db
}

func request(ref string) idempotency.Request {
	p := posting.Posting{Account: "acct-1", Cents: 100, Ref: ref}
	payload, _ := json.Marshal(p)
	return idempotency.Request{Key: p.Key(), TaskType: posting.TaskType, Fingerprint: idempotency.Fingerprint(posting.TaskType, payload)}
}

func insert(ctx context.Context, tx *sql.Tx, ref string) (int64, error) {
	var id int64
	err := tx.QueryRowContext(ctx, `INSERT INTO postings (account, cents, ref) VALUES ('acct-1', 100, $1) RETURNING id`, ref).Scan(&id)
	return id, err
}

func count(t *testing.T, db *sql.DB, ref string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM postings WHERE ref = $1`, ref).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func jsonEqual(a, b json.RawMessage) bool {
	var x, y any
	return json.Unmarshal(a, &x) == nil && json.Unmarshal(b, &y) == nil && fmt.Sprint(x) == fmt.Sprint(y)
}

// Concurrent deliveries of one key on lib/pq: one row, one answer, the duplicates
// answered from the ledger.
func TestPqConcurrentDuplicatesOneEffect(t *testing.T) {
	t.Parallel()
	ctx := exampletest.Context(t, 2*time.Minute)
	l, db := pqLedger(t, idempotency.Config{})
	const workers = 16
	answers := make([]json.RawMessage, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for {
				res, err := l.DoSQLTx(ctx, request("dup"), func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
					id, err := insert(ctx, tx, "dup")
					time.Sleep(2 * time.Millisecond) // widen the window
					return posting.Result(id), err
				})
				if errors.Is(err, idempotency.ErrBusy) && ctx.Err() == nil {
					time.Sleep(5 * time.Millisecond)
					continue
				}
				if err != nil {
					t.Errorf("worker %d: %v", w, err)
					return
				}
				answers[w] = res.Result
				return
			}
		})
	}
	wg.Wait()
	if n := count(t, db, "dup"); n != 1 {
		t.Fatalf("rows = %d, want 1", n)
	}
	for w := range workers {
		if !jsonEqual(answers[w], answers[0]) {
			t.Errorf("worker %d answered %s, worker 0 %s: want one answer", w, answers[w], answers[0])
		}
	}
	if r, err := l.Get(ctx, request("dup").Key); err != nil || r.Status != idempotency.StatusCompleted || r.Attempts != 1 {
		t.Errorf("ledger row %+v, %v: want completed at attempt 1", r, err)
	}
}

// A permanent error, a result jsonb refuses and a handler error on lib/pq: the first two
// are recorded failed, none leaves a row of postings; a handler that commits tx itself is
// told so.
func TestPqFailures(t *testing.T) {
	t.Parallel()
	ctx := exampletest.Context(t, time.Minute)
	l, db := pqLedger(t, idempotency.Config{})

	_, err := l.DoSQLTx(ctx, request("declined"), func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
		if _, err := insert(ctx, tx, "declined"); err != nil {
			return nil, err
		}
		return nil, idempotency.Permanent(errors.New("account closed"))
	})
	if !idempotency.IsPermanent(err) {
		t.Fatalf("permanent failure: %v, want the permanent error", err)
	}
	if r, err := l.Get(ctx, request("declined").Key); err != nil || r.Status != idempotency.StatusFailed || r.LastError != "account closed" {
		t.Errorf("ledger row %+v, %v: want failed with the reason", r, err)
	}
	if n := count(t, db, "declined"); n != 0 {
		t.Errorf("a permanently failed posting left %d rows", n)
	}

	_, err = l.DoSQLTx(ctx, request("refused"), func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
		_, err := insert(ctx, tx, "refused")
		return json.RawMessage(`1e1000000`), err // valid JSON that jsonb refuses
	})
	r, gerr := l.Get(ctx, request("refused").Key)
	if err == nil || gerr != nil || r.Status != idempotency.StatusFailed || !strings.Contains(r.LastError, "refused by the database") {
		t.Errorf("a result jsonb refuses: %v; ledger row %+v, %v: want an error and the key failed", err, r, gerr)
	}
	if n := count(t, db, "refused"); n != 0 {
		t.Errorf("a refused result left %d rows", n)
	}

	_, err = l.DoSQLTx(ctx, request("boom"), func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
		if _, err := insert(ctx, tx, "boom"); err != nil {
			return nil, err
		}
		return nil, errors.New("boom")
	})
	if err == nil || err.Error() != "boom" {
		t.Errorf("handler error: %v, want boom", err)
	}
	if _, err := l.Get(ctx, request("boom").Key); !errors.Is(err, idempotency.ErrNotFound) {
		t.Errorf("ledger row after a handler error: %v, want none", err)
	}
	if n := count(t, db, "boom"); n != 0 {
		t.Errorf("a failed handler left %d rows", n)
	}

	_, err = l.DoSQLTx(ctx, request("commits"), func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
		return nil, tx.Commit()
	})
	if err == nil || !strings.Contains(err.Error(), "ended the transaction") {
		t.Errorf("a handler that committed tx itself: %v, want it told", err)
	}
}

// A key another DoSQLTx holds on lib/pq waits up to ClaimLockTimeout and is busy; once
// the holder completed it, a duplicate gets its answer without running.
func TestPqBusyKey(t *testing.T) {
	t.Parallel()
	ctx := exampletest.Context(t, time.Minute)
	l, db := pqLedger(t, idempotency.Config{ClaimLockTimeout: 200 * time.Millisecond})
	entered, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := l.DoSQLTx(ctx, request("held"), func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
			id, err := insert(ctx, tx, "held")
			close(entered)
			<-release
			return posting.Result(id), err
		})
		done <- err
	}()
	<-entered
	_, err := l.DoSQLTx(ctx, request("held"), func(context.Context, *sql.Tx) (json.RawMessage, error) {
		t.Error("the handler ran on a key another transaction holds")
		return nil, nil
	})
	if !errors.Is(err, idempotency.ErrBusy) {
		t.Errorf("DoSQLTx on a held key: %v, want ErrBusy", err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatalf("the holder: %v", err)
	}
	res, err := l.DoSQLTx(ctx, request("held"), func(context.Context, *sql.Tx) (json.RawMessage, error) {
		t.Error("the handler ran on a completed key")
		return nil, nil
	})
	if err != nil || !res.Cached {
		t.Errorf("after the holder: %+v, %v; want its answer, cached", res, err)
	}
	if n := count(t, db, "held"); n != 1 {
		t.Errorf("rows = %d, want 1", n)
	}
}
