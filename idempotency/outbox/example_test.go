package outbox_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency/outbox"
)

// A web handler accepts an order and its job in one transaction: either both are stored
// or neither, and the relay publishes the job after the commit.
func ExampleClient_EnqueueTx() {
	var (
		ctx  = context.Background()
		pool *pgxpool.Pool // your Postgres, with idemq's migrations applied
		rdb  *redis.Client // the Redis asynq uses
	)
	if pool == nil || rdb == nil {
		return // (set them up in your program)
	}
	client := outbox.NewClient(pool, rdb, nil)
	go client.RunRelay(ctx)

	spec := outbox.Spec{Key: "invoice:2026-0042", Type: "invoice:send", Payload: []byte(`{"invoice":"2026-0042"}`),
		Queue: "default", MaxRetry: 10, Timeout: time.Minute, Retention: 24 * time.Hour}
	var res outbox.EnqueueResult
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE invoices SET state = 'sending' WHERE id = $1`, "2026-0042"); err != nil {
			return err
		}
		var err error
		res, err = client.EnqueueTx(ctx, tx, spec)
		return err
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	client.Wake(ctx)
	fmt.Println(res.Key, res.Duplicate)
}
