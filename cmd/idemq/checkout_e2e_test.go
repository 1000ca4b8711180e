package main

import (
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// A checkout is three recorded steps. The worker is SIGKILLed after the provider stored the
// receipt email and before the step was recorded; a later delivery takes the checkout over
// and resumes after its last recorded step: the card is not charged again (no second charge
// request), the order is not recorded again, and only the receipt, whose provider honours
// no key, is sent again — by the owner with the newer fence.
func TestCheckoutResumesAfterItsLastRecordedStep(t *testing.T) {
	t.Parallel()
	s := startStack(t, 0, []string{"IDEMQ_FAKEPAY_HONOR_KEYS=true"}, []string{"IDEMQ_LEASE=8s"})
	proxy := holdAnswers(t, s.fakepayURL, 3*time.Second)
	s.workerEnv = append(s.workerEnv, "IDEMQ_FAKEPAY_URL="+proxy) // the later value wins
	s.startWorker(t, 0)

	ctx := testenv.Context(t, 2*time.Minute)
	c := tasks.Checkout{OrderID: "co-killed", CustomerID: "c-co", AmountCents: 2500, Currency: "EUR", Email: "ann@example.com"}
	task, err := tasks.NewCheckoutTask(c)
	if err != nil {
		t.Fatal(err)
	}
	s.enqueue(t, task)
	count := func(query string) int {
		var n int
		if err := s.pool.QueryRow(ctx, query, c.OrderID).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for count(`SELECT count(*) FROM fakepay_emails WHERE order_id = $1`) == 0 {
		if ctx.Err() != nil {
			t.Fatal("the provider never received the receipt")
		}
		time.Sleep(20 * time.Millisecond)
	}
	s.workers[0].signal(syscall.SIGKILL)
	<-s.workers[0].done
	if n := count(`SELECT count(*) FROM processed_job_steps WHERE idempotency_key = 'checkout:' || $1`); n != 2 {
		t.Fatalf("%d steps recorded when the worker died after sending the receipt, want 2 (charge, record)", n)
	}

	// asynq would redeliver only after its own recovery (60–120 s); a duplicate delivery
	// under another TaskID takes the checkout over once the 8 s lease has run out.
	s.startWorker(t, 0)
	dup, _ := tasks.NewCheckoutTask(c)
	s.enqueue(t, dup, asynq.TaskID(c.Key()+"-dup"))
	s.waitCompleted(t, 1, 60*time.Second)

	charges := count(`SELECT count(*) FROM fakepay_requests WHERE order_id = $1`)
	orders := count(`SELECT count(*) FROM orders WHERE order_id = $1`)
	emails := count(`SELECT count(*) FROM fakepay_emails WHERE order_id = $1`)
	steps := count(`SELECT count(*) FROM processed_job_steps WHERE idempotency_key = 'checkout:' || $1`)
	if charges != 1 || orders != 1 || emails != 2 || steps != 3 {
		t.Fatalf("charge requests %d, order rows %d, emails %d, steps recorded %d; want 1, 1, 2 (the unrecorded receipt sent again), 3", charges, orders, emails, steps)
	}
	var first, second int64
	if err := s.pool.QueryRow(ctx, `SELECT min(fence), max(fence) FROM fakepay_emails WHERE order_id = $1`, c.OrderID).Scan(&first, &second); err != nil {
		t.Fatal(err)
	}
	if first == 0 || second <= first {
		t.Fatalf("receipt fences %d and %d: want the second sent under the takeover's newer fence", first, second)
	}
	t.Logf("killed after the receipt's effect: 1 charge request, 1 order row, emails under fences %d and %d", first, second)
}
