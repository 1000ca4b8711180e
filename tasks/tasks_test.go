package tasks_test

import (
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

func TestDecodeCharge(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", 249) // "charge:" + 249 = 256 bytes
	for _, tc := range []struct {
		name, payload, wantErr string
	}{
		{"ok", `{"order_id":"o-1","customer_id":"c-1","amount_cents":1999,"currency":"EUR"}`, ""},
		{"malformed", `{"order_id":`, "malformed payload"},
		{"unknown field", `{"order_id":"o","customer_id":"c","amount_cents":1,"currency":"EUR","tip":1}`, `unknown field "tip"`},
		{"trailing data", `{"order_id":"o","customer_id":"c","amount_cents":1,"currency":"EUR"} {}`, "data after the JSON object"},
		{"missing order", `{"customer_id":"c","amount_cents":1,"currency":"EUR"}`, "order_id: required"},
		{"negative amount", `{"order_id":"o","customer_id":"c","amount_cents":-5,"currency":"EUR"}`, "amount_cents: must be a positive"},
		{"zero amount", `{"order_id":"o","customer_id":"c","amount_cents":0,"currency":"EUR"}`, "amount_cents"},
		{"currency with a digit", `{"order_id":"o","customer_id":"c","amount_cents":1,"currency":"E1R"}`, "currency: must be a three-letter ISO 4217 code"},
		{"space in id", `{"order_id":"o 1","customer_id":"c","amount_cents":1,"currency":"EUR"}`, "order_id: byte 1"},
		{"non-ASCII id", `{"order_id":"ö","customer_id":"c","amount_cents":1,"currency":"EUR"}`, "order_id: byte 0"},
		{"key too long", `{"order_id":"` + long + `","customer_id":"c","amount_cents":1,"currency":"EUR"}`, "the limit is 248"},
		{"wrong type", `{"order_id":"o","customer_id":"c","amount_cents":"1","currency":"EUR"}`, "amount_cents"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := tasks.DecodeCharge([]byte(tc.payload))
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("got error %v, want none", err)
				}
				if c.Key() != "charge:o-1" || c.LockScope() != "customer:c-1" {
					t.Fatalf("key, scope = %q, %q; want charge:o-1, customer:c-1", c.Key(), c.LockScope())
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("got error %v, want one containing %q", err, tc.wantErr)
			}
		})
	}
}

func TestDecodeDebit(t *testing.T) {
	t.Parallel()
	d, err := tasks.DecodeDebit([]byte(`{"account_id":"a-1","amount_cents":250,"reference":"r-9"}`))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := d, (tasks.Debit{AccountID: "a-1", AmountCents: 250, Reference: "r-9"}); got != want {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	if d.Key() != "debit:r-9" || d.LockScope() != "account:a-1" {
		t.Fatalf("key, scope = %q, %q", d.Key(), d.LockScope())
	}
	for payload, want := range map[string]string{
		`{"account_id":"a","amount_cents":1}`:                          "reference: required",
		`{"account_id":"a","amount_cents":1,"reference":"r","x":true}`: "unknown field",
		`[]`: "malformed payload",
		`{"account_id":"a","amount_cents":1,"reference":"` + strings.Repeat("r", idempotency.MaxPayloadBytes) + `"}`: "the limit is 65536",
	} {
		if _, err := tasks.DecodeDebit([]byte(payload)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("DecodeDebit(%.40q…) = %v, want error containing %q", payload, err, want)
		}
	}
}

func TestNewTaskRefusesInvalidPayload(t *testing.T) {
	t.Parallel()
	_, err := tasks.NewChargeTask(tasks.Charge{OrderID: strings.Repeat("o", 300), CustomerID: "c", AmountCents: 1, Currency: "EUR"})
	if err == nil || !strings.Contains(err.Error(), "payment:charge: order_id: 300 bytes; the limit is 248") {
		t.Fatalf("got %v, want an error naming the limit", err)
	}
	if _, err := tasks.NewDebitTask(tasks.Debit{AccountID: "a", AmountCents: -1, Reference: "r"}); err == nil {
		t.Fatal("negative debit accepted")
	}
}

func TestEnqueueReportsDuplicate(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 30*time.Second)
	rdb := testenv.Redis(t)
	client := asynq.NewClientFromRedisClient(rdb)

	charge := tasks.Charge{OrderID: "o-7", CustomerID: "c-1", AmountCents: 500, Currency: "USD"}
	task, err := tasks.NewChargeTask(charge)
	if err != nil {
		t.Fatal(err)
	}
	info, dup, err := tasks.Enqueue(ctx, client, task)
	if err != nil || dup {
		t.Fatalf("first enqueue: dup=%v err=%v, want a new task", dup, err)
	}
	if info.ID != "charge:o-7" || info.Queue != tasks.Queue || info.MaxRetry != tasks.DefaultMaxRetry || info.Retention != tasks.DefaultRetention {
		t.Fatalf("task info = id %q queue %q retry %d retention %s", info.ID, info.Queue, info.MaxRetry, info.Retention)
	}
	if _, ok := idempotency.FirstEnqueued(task.Headers()); !ok {
		t.Fatalf("task has no %s header: %v", idempotency.HeaderFirstEnqueued, task.Headers())
	}

	again, _ := tasks.NewChargeTask(charge)
	info, dup, err = tasks.Enqueue(ctx, client, again)
	if err != nil || !dup || info != nil {
		t.Fatalf("second enqueue: info=%v dup=%v err=%v, want a duplicate", info, dup, err)
	}
	n, err := asynq.NewInspectorFromRedisClient(rdb).GetQueueInfo(tasks.Queue)
	if err != nil {
		t.Fatal(err)
	}
	if n.Pending != 1 {
		t.Fatalf("pending tasks = %d, want 1", n.Pending)
	}
}

func TestAmountHasAMaximum(t *testing.T) {
	t.Parallel()
	huge := "9" + strings.Repeat("0", 49_999) // 50,000 digits
	for _, tc := range []struct {
		name, amount string
		ok           bool
	}{
		{"the maximum", "99999999999", true},
		{"one over", "100000000000", false},
		{"int64's maximum", "9223372036854775807", false},
		{"past int64", "9223372036854775808", false},
		{"50,000 digits", huge, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			charge := `{"order_id":"o","customer_id":"c","amount_cents":` + tc.amount + `,"currency":"EUR"}`
			debit := `{"account_id":"a","amount_cents":` + tc.amount + `,"reference":"r"}`
			_, cerr := tasks.DecodeCharge([]byte(charge))
			_, derr := tasks.DecodeDebit([]byte(debit))
			for _, err := range []error{cerr, derr} {
				if tc.ok {
					if err != nil {
						t.Fatalf("got error %v, want none", err)
					}
					continue
				}
				if err == nil || !strings.Contains(err.Error(), "amount_cents") || !strings.Contains(err.Error(), "99999999999") {
					t.Fatalf("got error %.300v, want one naming amount_cents and the maximum 99999999999", err)
				}
				if len(err.Error()) > 200 {
					t.Fatalf("error is %d bytes, want the value cut short: %.300s", len(err.Error()), err)
				}
			}
		})
	}
	if _, err := tasks.ChargeSpec(tasks.Charge{OrderID: "o", CustomerID: "c", AmountCents: tasks.MaxAmountCents + 1, Currency: "EUR"}); err == nil {
		t.Fatal("ChargeSpec accepted an amount over MaxAmountCents")
	}
	if _, err := tasks.DebitSpec(tasks.Debit{AccountID: "a", AmountCents: tasks.MaxAmountCents, Reference: "r"}); err != nil {
		t.Fatalf("DebitSpec refused MaxAmountCents: %v", err)
	}
}
