package idempotencytest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency/idempotencytest"
	"github.com/idemq/idemq/idempotency/server"
	"github.com/idemq/idemq/internal/testenv"
)

// Refund is an application's own job: refund an order, once.
type Refund struct {
	OrderID string `json:"order_id"`
	Cents   int64  `json:"cents"`
}

func (r Refund) Key() string       { return "refund:" + r.OrderID }
func (r Refund) LockScope() string { return "order:" + r.OrderID }

func decodeRefund(b []byte) (Refund, error) {
	var r Refund
	if err := json.Unmarshal(b, &r); err != nil || r.OrderID == "" {
		return Refund{}, fmt.Errorf("refund payload: %v", err)
	}
	return r, nil
}

// refund is the application's handler: its effect is a row in its own table, written
// through the transaction it is given.
func refund(ctx context.Context, tx pgx.Tx, r Refund) (json.RawMessage, error) {
	_, err := tx.Exec(ctx, `INSERT INTO refunds (order_id, cents) VALUES ($1, $2)`, r.OrderID, r.Cents)
	return json.RawMessage(`{"refunded":true}`), err
}

// registerRefunds registers the application's jobs: on its server.Server in main, on the
// harness's workers in its tests.
func registerRefunds(r server.Registrar) {
	server.HandleTx(r, "billing:refund", refund, server.WithDecoder(decodeRefund))
}

// refundHarness is how the application's test sets the harness up: its handlers
// registered as its server registers them, and the refund case with its effect counter.
func refundHarness(pool *pgxpool.Pool, rdb *redis.Client) (idempotencytest.Config, idempotencytest.Case) {
	cfg := idempotencytest.Config{
		Pool: pool, Redis: rdb,
		Handlers: registerRefunds,
	}
	c := idempotencytest.Case{
		Name: "refund",
		Task: func(id string) (*asynq.Task, error) {
			payload, err := json.Marshal(Refund{OrderID: "o-" + id, Cents: 500})
			return asynq.NewTask("billing:refund", payload), err
		},
		Effects: func(ctx context.Context, id string) (n int, err error) {
			err = pool.QueryRow(ctx, `SELECT count(*) FROM refunds WHERE order_id = $1`, "o-"+id).Scan(&n)
			return n, err
		},
	}
	return cfg, c
}

// The harness delivers the application's refund under every schedule (duplicates,
// crashes before and after the effect, a stale owner, an error after the effect, Redis
// loss, a shared commit) and wants exactly one row per order each time. pool and rdb are
// the test's own Postgres (migrated with idemq's migrations and the application's) and
// Redis.
func Example() {
	var pool *pgxpool.Pool // the test's, migrated
	var rdb *redis.Client  // the test's
	testRefunds := func(t *testing.T) {
		cfg, refunds := refundHarness(pool, rdb)
		idempotencytest.Run(t, cfg, refunds)
	}
	_ = testRefunds // func TestRefunds(t *testing.T) { … } in the application's tests
}

// Verify runs one schedule and returns what it saw, here four deliveries of one refund at
// once on two worker processes: one refund row, and no problem.
func ExampleVerify() {
	ctx := context.Background()
	pool, dropSchema := testenv.ExamplePostgres(true) // migrated with idemq's migrations
	defer dropSchema()
	rdb, releaseRedis := testenv.ExampleRedis()
	defer releaseRedis()
	if _, err := pool.Exec(ctx, `CREATE TABLE refunds (order_id text, cents bigint)`); err != nil { // the application's
		fmt.Println(err)
		return
	}

	cfg, refunds := refundHarness(pool, rdb)
	rep, err := idempotencytest.Verify(ctx, cfg, refunds, idempotencytest.ConcurrentDuplicates)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%s: effects %d, failed %t, problems %q\n", rep.Schedule, rep.Effects, rep.Failed(), rep.Problems)
	// Output:
	// concurrent-duplicates: effects 1, failed false, problems []
}
