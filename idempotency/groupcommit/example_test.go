package groupcommit_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/idempotency/groupcommit"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/testenv"
)

type order struct {
	ID    string
	Cents int
}

// Ten goroutines record an order each; their rows go in shared transactions, one insert
// per round. One order breaks a constraint: its round is sent again in halves, and only
// that order fails.
func Example() {
	ctx := context.Background()
	pool, cleanup := testenv.ExamplePostgres(false) // a schema of its own
	defer cleanup()
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id text PRIMARY KEY, cents int NOT NULL CHECK (cents > 0))`); err != nil {
		fmt.Println(err)
		return
	}

	orders := groupcommit.New(groupcommit.Config[order]{
		Workers:  2,
		MaxBatch: 128,
		Timeout:  10 * time.Second,
		Keys:     func(o order) []string { return []string{o.ID} },
		Send: func(ctx context.Context, round []order) error {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(context.WithoutCancel(ctx))
			ids, cents := make([]string, len(round)), make([]int32, len(round))
			for i, o := range round {
				ids[i], cents[i] = o.ID, int32(o.Cents)
			}
			// The transaction's id, read with the round's insert in one round trip, lets
			// Commit resolve a COMMIT whose answer was lost.
			var id groupcommit.TxID
			b := &pgx.Batch{}
			b.Queue(groupcommit.TxIDSQL).QueryRow(func(r pgx.Row) error { return r.Scan(&id.Xid, &id.ServerStart) })
			b.Queue(`INSERT INTO orders (id, cents) SELECT * FROM unnest($1::text[], $2::int[])`, ids, cents)
			if err := tx.SendBatch(ctx, b).Close(); err != nil {
				return err
			}
			return groupcommit.Commit(ctx, tx, pool, id, 10*time.Second)
		},
		Refused: outbox.Refused, // a constraint or a lock refused one row: split the round
	})

	errs := make([]error, 10)
	var wg sync.WaitGroup
	for i := range errs {
		wg.Go(func() {
			o := order{ID: fmt.Sprintf("o-%d", i), Cents: 100 * i} // o-0 has no amount
			errs[i] = orders.Run(ctx, o)
		})
	}
	wg.Wait()

	for i, err := range errs {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			fmt.Printf("o-%d refused: %s\n", i, pgErr.ConstraintName)
		} else if err != nil {
			fmt.Printf("o-%d: %v\n", i, err)
		}
	}
	var n int
	pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&n)
	fmt.Println("orders recorded:", n)
	// Output:
	// o-0 refused: orders_cents_check
	// orders recorded: 9
}
