package server_test

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/idempotency/server"
	"github.com/idemq/idemq/internal/testenv"
)

// A server runs until its context ends. Here one debit is accepted three times through
// the outbox (one intent; the others are duplicates) and also published straight to
// asynq under another TaskID: the account is debited once.
func ExampleServer_Run() {
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	pool, dropSchema := testenv.ExamplePostgres(true) // your Postgres, with idemq's migrations applied
	defer dropSchema()
	rdb, releaseRedis := testenv.ExampleRedis() // the Redis asynq uses
	defer releaseRedis()

	if _, err := pool.Exec(ctx, `CREATE TABLE debits (account text, cents bigint, ref text)`); err != nil { // your own table
		fmt.Println(err)
		return
	}
	srv, err := server.New(server.Config{Postgres: pool, Redis: rdb})
	if err != nil {
		fmt.Println(err)
		return
	}
	server.HandleTx(srv, "wallet:debit", func(ctx context.Context, tx pgx.Tx, d Debit) (json.RawMessage, error) {
		_, err := tx.Exec(ctx, `INSERT INTO debits (account, cents, ref) VALUES ($1, $2, $3)`, d.Account, d.Cents, d.Ref)
		return json.RawMessage(`{"debited": true}`), err
	})
	ran := make(chan error, 1)
	go func() { ran <- srv.Run(ctx) }()

	spec := outbox.Spec{Key: "debit:r-1", Type: "wallet:debit", Payload: []byte(`{"account":"acct-1","cents":250,"ref":"r-1"}`)}
	for range 3 {
		res, err := srv.Outbox().Enqueue(ctx, spec)
		fmt.Println("duplicate:", res.Duplicate, err)
	}
	// A plain asynq producer's duplicate, under a TaskID of its own.
	client := asynq.NewClientFromRedisClient(rdb)
	if _, err := client.Enqueue(asynq.NewTask(spec.Type, spec.Payload), asynq.TaskID("plain-1"), asynq.Retention(time.Hour)); err != nil {
		fmt.Println(err)
		return
	}

	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if rec, err := srv.Ledger().Get(ctx, spec.Key); err == nil && rec.Status == "completed" {
			fmt.Println("status:", rec.Status, string(rec.Result))
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	inspector := asynq.NewInspectorFromRedisClient(rdb)
	for time.Now().Before(deadline) { // the plain duplicate finds the key done: cached
		if info, err := inspector.GetTaskInfo("default", "plain-1"); err == nil && info.State == asynq.TaskStateCompleted {
			fmt.Println("plain duplicate:", string(info.Result))
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM debits WHERE ref = 'r-1'`).Scan(&n); err != nil {
		fmt.Println(err)
	}
	fmt.Println("debits:", n)
	stop()
	fmt.Println("run:", <-ran)
	// Output:
	// duplicate: false <nil>
	// duplicate: true <nil>
	// duplicate: true <nil>
	// status: completed {"debited": true}
	// plain duplicate: {"debited": true}
	// debits: 1
	// run: <nil>
}
