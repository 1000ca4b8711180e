package asynqmw_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/lock"
)

// Refund is a payload of your own: a job needs a key from intent and a lock scope.
type Refund struct {
	PaymentID string `json:"payment_id"`
	Cents     int64  `json:"cents"`
}

func (r Refund) Key() string       { return "refund:" + r.PaymentID }
func (r Refund) LockScope() string { return r.Key() }

// decodeRefund decodes strictly: its error archives the task with the reason.
func decodeRefund(b []byte) (Refund, error) {
	var r Refund
	if err := json.Unmarshal(b, &r); err != nil {
		return Refund{}, err
	}
	if r.PaymentID == "" || r.Cents <= 0 {
		return Refund{}, errors.New("payment_id and a positive cents are required")
	}
	return r, nil
}

// A transactional handler: its writes and the key's completion commit together, so a
// refund row exists exactly when the key is completed, however often asynq delivers it.
func Example() {
	var (
		pool *pgxpool.Pool // your Postgres, with idemq's migrations applied
		rdb  *redis.Client // the Redis asynq uses
	)
	if pool == nil || rdb == nil {
		return // (set them up in your program)
	}
	ledger := idempotency.New(pool, nil)
	defer ledger.Close()
	w := asynqmw.NewWorker(ledger, lock.New(rdb, nil), nil)

	mux := asynq.NewServeMux()
	mux.Handle("payment:refund", asynqmw.Transactional(w, "payment:refund", decodeRefund,
		func(ctx context.Context, tx pgx.Tx, r Refund) (json.RawMessage, error) {
			_, err := tx.Exec(ctx, `INSERT INTO refunds (payment_id, cents) VALUES ($1, $2)`, r.PaymentID, r.Cents)
			return json.RawMessage(fmt.Sprintf(`{"refunded":%d}`, r.Cents)), err
		}))

	cfg := asynq.Config{Concurrency: 20}
	asynqmw.Configure(&cfg) // a busy key or lock is retried soon, and is not a failure
	srv := asynq.NewServerFromRedisClient(rdb, cfg)
	if err := srv.Run(mux); err != nil {
		fmt.Println(err)
	}
}
