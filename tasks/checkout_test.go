package tasks_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/tasks"
)

func TestCheckoutKeyScopeAndSpec(t *testing.T) {
	c := tasks.Checkout{OrderID: "o-1", CustomerID: "c-1", AmountCents: 1999, Currency: "eur", Email: "ann@example.com"}
	if c.Key() != "checkout:o-1" || c.LockScope() != "customer:c-1" {
		t.Fatalf("key %q scope %q", c.Key(), c.LockScope())
	}
	s, err := tasks.CheckoutSpec(c)
	if err != nil {
		t.Fatal(err)
	}
	if s.Type != tasks.TypeCheckout || s.Key != "checkout:o-1" || s.Queue != tasks.Queue || s.MaxRetry != tasks.DefaultMaxRetry {
		t.Fatalf("spec %+v", s)
	}
	got, err := tasks.DecodeCheckout(s.Payload)
	if err != nil || got.Currency != "EUR" || got.Email != c.Email {
		t.Fatalf("decode of the spec's payload: %+v %v (currency in canonical upper case)", got, err)
	}
	task, err := tasks.NewCheckoutTask(c)
	if err != nil || task.Type() != tasks.TypeCheckout {
		t.Fatalf("task %v %v", task, err)
	}
}

// The longest step key of a checkout fits the key limit: the order id leaves room for it.
func TestCheckoutOrderIDLeavesRoomForStepKeys(t *testing.T) {
	longest := ""
	for _, s := range tasks.CheckoutSteps {
		if len(s) > len(longest) {
			longest = s
		}
	}
	max := idempotency.MaxKeyBytes - len("checkout:") - len("#s/") - len(longest)
	ok := tasks.Checkout{OrderID: strings.Repeat("o", max), CustomerID: "c", AmountCents: 1, Currency: "EUR", Email: "a@b.c"}
	if err := ok.Validate(); err != nil {
		t.Fatalf("an order id of %d bytes: %v", max, err)
	}
	if stepKey := ok.Key() + "#s/" + longest; len(stepKey) != idempotency.MaxKeyBytes {
		t.Fatalf("the longest step key is %d bytes, want exactly %d", len(stepKey), idempotency.MaxKeyBytes)
	}
	ok.OrderID += "o"
	err := ok.Validate()
	if err == nil || !strings.Contains(err.Error(), "order_id") || !strings.Contains(err.Error(), "step keys") {
		t.Fatalf("an order id one byte longer: %v, want a refusal naming the step keys' limit", err)
	}
}

// A bad email is refused naming the field, never quoting the address.
func TestCheckoutEmailIsCheckedNotQuoted(t *testing.T) {
	base := tasks.Checkout{OrderID: "o-1", CustomerID: "c-1", AmountCents: 1, Currency: "EUR"}
	for _, email := range []string{"", "no-at-sign", "two@@example.com", "@example.com", "ann@", "ann smith@example.com",
		"ann@exämple.com", strings.Repeat("a", 250) + "@b.co"} {
		c := base
		c.Email = email
		err := c.Validate()
		if err == nil || !strings.HasPrefix(err.Error(), "email: ") {
			t.Errorf("email %q: %v, want a refusal naming email", email, err)
			continue
		}
		if email != "" && strings.Contains(err.Error(), email) {
			t.Errorf("email %q: the error quotes it: %v", email, err)
		}
	}
	payload, _ := json.Marshal(map[string]any{"order_id": "o-1", "customer_id": "c-1", "amount_cents": 1, "currency": "EUR", "email": "a@b.c", "extra": 1})
	if _, err := tasks.DecodeCheckout(payload); err == nil {
		t.Error("an unknown field was accepted")
	}
}
