package shop_test

import (
	"context"
	"encoding/json"
	"os"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"example.com/shop"
	"github.com/idemq/idemq/idempotency/idempotencytest"
	"github.com/idemq/idemq/idempotency/server"
)

// TestExactlyOnce delivers a refund and a receipt under every schedule of the harness
// (duplicates, crashes, a stale worker, Redis losing the task…) and wants one refund row
// and one receipt per order each time.
func TestExactlyOnce(t *testing.T) {
	dsn, redisURL := os.Getenv("TEST_DATABASE_URL"), os.Getenv("TEST_REDIS_URL")
	if dsn == "" || redisURL == "" {
		t.Skip("set TEST_DATABASE_URL and TEST_REDIS_URL")
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := shop.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		t.Fatal(err)
	}
	opt, err := redis.ParseURL(redisURL)
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { rdb.Close() })

	mailer := shop.Mailer{DB: pool}
	cfg := idempotencytest.Config{
		Pool: pool, Redis: rdb,
		Handlers: func(r server.Registrar) { shop.Register(r, mailer) },
	}
	count := func(query string) func(ctx context.Context, id string) (int, error) {
		return func(ctx context.Context, id string) (n int, err error) {
			err = pool.QueryRow(ctx, query, "o-"+id).Scan(&n)
			return n, err
		}
	}
	idempotencytest.Run(t, cfg,
		idempotencytest.Case{
			Name: "refund",
			Task: func(id string) (*asynq.Task, error) {
				payload, err := json.Marshal(shop.Refund{Order: "o-" + id, Cents: 500})
				return asynq.NewTask(shop.TypeRefund, payload), err
			},
			Effects: count(`SELECT count(*) FROM refunds WHERE order_id = $1`),
		},
		idempotencytest.Case{
			Name: "receipt",
			Task: func(id string) (*asynq.Task, error) {
				payload, err := json.Marshal(shop.Receipt{Order: "o-" + id, To: "o-" + id + "@example.com"})
				return asynq.NewTask(shop.TypeReceipt, payload), err
			},
			Effects: count(`SELECT count(*) FROM receipts WHERE order_id = $1`),
		})
}
