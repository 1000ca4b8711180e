package outbox_test

import (
	"context"
	"fmt"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/testenv"
)

// A web handler accepts an order and its job in one transaction: either both are stored
// or neither, and the relay publishes the job after the commit, under TaskID = key. A
// client that repeats its request gets a duplicate, never a second job.
func ExampleClient_EnqueueTx() {
	ctx := context.Background()
	pool, dropSchema := testenv.ExamplePostgres(true) // your Postgres, with idemq's migrations applied
	defer dropSchema()
	rdb, releaseRedis := testenv.ExampleRedis() // the Redis asynq uses
	defer releaseRedis()
	if _, err := pool.Exec(ctx, `CREATE TABLE invoices (id text PRIMARY KEY, state text NOT NULL);
		INSERT INTO invoices VALUES ('2026-0042', 'draft')`); err != nil {
		fmt.Println(err)
		return
	}

	client := outbox.NewClient(pool, rdb, nil)
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- client.RunRelay(relayCtx) }()
	defer func() { stopRelay(); <-relayDone }() // before the schema and Redis go

	spec := outbox.Spec{Key: "invoice:2026-0042", Type: "invoice:send", Payload: []byte(`{"invoice":"2026-0042"}`),
		Queue: "default", MaxRetry: 10, Timeout: time.Minute, Retention: 24 * time.Hour}
	accept := func() (outbox.EnqueueResult, error) {
		var res outbox.EnqueueResult
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `UPDATE invoices SET state = 'sending' WHERE id = $1`, "2026-0042"); err != nil {
				return err
			}
			var err error
			res, err = client.EnqueueTx(ctx, tx, spec)
			return err
		})
		client.Wake(ctx) // publish now rather than at the relay's next poll
		return res, err
	}

	res, err := accept()
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("accepted %s: duplicate=%t state=%s\n", res.Key, res.Duplicate, res.State)

	// Wait for the relay, then look at the task in asynq.
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if in, err := client.Intent(ctx, spec.Key); err == nil && in.State == outbox.IntentPublished {
			break
		}
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	if info, err := insp.GetTaskInfo(spec.Queue, spec.Key); err != nil {
		fmt.Println(err)
	} else {
		fmt.Printf("asynq: task %s of type %s is %s\n", info.ID, info.Type, info.State)
	}

	res, err = accept()
	fmt.Printf("again: duplicate=%t state=%s %v\n", res.Duplicate, res.State, err)
	// Output:
	// accepted invoice:2026-0042: duplicate=false state=pending
	// asynq: task invoice:2026-0042 of type invoice:send is pending
	// again: duplicate=true state=published <nil>
}
