package asynqmw_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/internal/testenv"
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
// Here the same refund is published three times, under three TaskIDs.
func Example() {
	ctx := context.Background()
	pool, dropSchema := testenv.ExamplePostgres(true) // your Postgres, with idemq's migrations applied
	defer dropSchema()
	rdb, releaseRedis := testenv.ExampleRedis() // the Redis asynq uses
	defer releaseRedis()
	if _, err := pool.Exec(ctx, `CREATE TABLE refunds (payment_id text, cents bigint)`); err != nil {
		fmt.Println(err)
		return
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

	cfg := asynq.Config{Concurrency: 20, LogLevel: asynq.FatalLevel}
	asynqmw.Configure(&cfg) // a busy key or lock is retried soon, and is not a failure
	srv := asynq.NewServerFromRedisClient(rdb, cfg)
	if err := srv.Start(mux); err != nil {
		fmt.Println(err)
		return
	}

	client := asynq.NewClientFromRedisClient(rdb)
	ids := []string{"refund:pay-7", "refund:pay-7#2", "refund:pay-7#3"}
	for _, id := range ids {
		task := asynq.NewTask("payment:refund", []byte(`{"payment_id":"pay-7","cents":500}`))
		if _, err := client.Enqueue(task, asynq.TaskID(id), asynq.Retention(time.Hour)); err != nil {
			fmt.Println(err)
			return
		}
	}

	// Wait until asynq has completed the three tasks, then shut down in order.
	insp := asynq.NewInspectorFromRedisClient(rdb)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		done := 0
		for _, id := range ids {
			if info, err := insp.GetTaskInfo("default", id); err == nil && info.State == asynq.TaskStateCompleted {
				done++
			}
		}
		if done == len(ids) || time.Now().After(deadline) {
			fmt.Println("tasks completed:", done)
			break
		}
	}
	w.Stop()
	srv.Shutdown()
	w.Wait()

	var rows int
	pool.QueryRow(ctx, `SELECT count(*) FROM refunds WHERE payment_id = 'pay-7'`).Scan(&rows)
	fmt.Println("refund rows:", rows)
	// Output:
	// tasks completed: 3
	// refund rows: 1
}
