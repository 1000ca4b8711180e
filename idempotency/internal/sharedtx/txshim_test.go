package sharedtx

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/testenv"
)

// TestInDBCountsTheDatabaseNotTheHandler: the time a handler waits on its queries (an
// Exec, rows read from a Query, a QueryRow's Scan, a batch's results) is counted in
// InDB; the time it spends on its own between them is not.
func TestInDBCountsTheDatabaseNotTheHandler(t *testing.T) {
	ctx := testenv.Context(t, time.Minute)
	pool := testenv.Postgres(t)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "BEGIN"); err != nil {
		t.Fatal(err)
	}
	defer conn.Exec(ctx, "ROLLBACK")

	const wait = 30 * time.Millisecond // each query sleeps this long in the database
	sleep := "SELECT pg_sleep(0.03)"
	steps := map[string]func(tx *handlerTx) error{
		"Exec": func(tx *handlerTx) error { _, err := tx.Exec(ctx, sleep); return err },
		"Query": func(tx *handlerTx) error {
			rows, err := tx.Query(ctx, sleep)
			if err != nil {
				return err
			}
			for rows.Next() {
			}
			rows.Close()
			return rows.Err()
		},
		"QueryRow": func(tx *handlerTx) error { return tx.QueryRow(ctx, "SELECT pg_sleep(0.03)::text").Scan(new(string)) },
		"SendBatch": func(tx *handlerTx) error {
			b := &pgx.Batch{}
			b.Queue(sleep)
			return tx.SendBatch(ctx, b).Close()
		},
	}
	for name, step := range steps {
		firstRan := false
		tx := newHandlerTx(conn.Conn(), func(context.Context) error { firstRan = true; return nil })
		time.Sleep(wait) // the handler's own time: not the database's
		if err := step(tx); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		time.Sleep(wait)
		if !firstRan {
			t.Errorf("%s: the first use did not run", name)
		}
		if got := tx.InDB(); got < wait || got >= 2*wait+wait/2 {
			t.Errorf("%s: InDB %s, want the query's %s (and none of the handler's %s)", name, got, wait, 2*wait)
		}
	}
}
