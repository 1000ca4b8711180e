package tasks_test

import (
	"context"
	"fmt"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// A charge's task carries its canonical payload ("eur" is "EUR"); its key, "charge:" and
// the order id, is the task's TaskID, the ledger key and the provider's idempotency key.
// The worker decodes the payload back with DecodeCharge.
func ExampleNewChargeTask() {
	c := tasks.Charge{OrderID: "123", CustomerID: "42", AmountCents: 1999, Currency: "eur"}
	t, err := tasks.NewChargeTask(c)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("type:", t.Type())
	fmt.Println("key:", c.Key())
	fmt.Println("lock scope:", c.LockScope())
	fmt.Printf("payload: %s\n", t.Payload())

	got, err := tasks.DecodeCharge(t.Payload())
	fmt.Printf("decoded: %+v %v\n", got, err)
	// Output:
	// type: payment:charge
	// key: charge:123
	// lock scope: customer:42
	// payload: {"order_id":"123","customer_id":"42","amount_cents":1999,"currency":"EUR"}
	// decoded: {OrderID:123 CustomerID:42 AmountCents:1999 Currency:EUR} <nil>
}

// Enqueueing the same order twice makes one job: the second publish finds the TaskID
// taken and reports a duplicate instead of an error.
func ExampleEnqueue() {
	rdb, cleanup := testenv.ExampleRedis() // the Redis asynq uses (a database of its own here)
	defer cleanup()
	client := asynq.NewClientFromRedisClient(rdb)
	defer client.Close()
	ctx := context.Background()

	for range 2 {
		t, err := tasks.NewChargeTask(tasks.Charge{OrderID: "123", CustomerID: "42", AmountCents: 1999, Currency: "EUR"})
		if err != nil {
			fmt.Println(err)
			return
		}
		info, dup, err := tasks.Enqueue(ctx, client, t)
		switch {
		case err != nil:
			fmt.Println(err)
		case dup:
			fmt.Println("duplicate: already enqueued")
		default:
			fmt.Printf("enqueued: TaskID %s, queue %s, max retry %d\n", info.ID, info.Queue, info.MaxRetry)
		}
	}
	// Output:
	// enqueued: TaskID charge:123, queue default, max retry 10
	// duplicate: already enqueued
}
