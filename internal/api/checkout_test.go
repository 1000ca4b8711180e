package api

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/tasks"
)

func checkoutBody(order string, amount int, email string) string {
	b, _ := json.Marshal(map[string]any{"order_id": order, "customer_id": "c-1", "amount_cents": amount, "currency": "EUR", "email": email})
	return string(b)
}

// TestAcceptCheckout: POST /v1/checkouts answers as POST /v1/charges does: 202 for a new
// order, 200 for the same body again (in any layout, the currency in any case), 422
// naming order_id for another body of the same order, and with an Idempotency-Key the
// replay and the 422 for the key reused with another body.
func TestAcceptCheckout(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	first := a.do(t, "POST", "/v1/checkouts", checkoutBody("o-1", 1999, "ann@example.com")).
		want(t, 202, `"key":"checkout:o-1"`, `"status":"accepted"`, `"duplicate":false`)
	if first.json["type"] != tasks.TypeCheckout {
		t.Fatalf("type %v, want %s", first.json["type"], tasks.TypeCheckout)
	}
	a.do(t, "POST", "/v1/checkouts", `{ "email":"ann@example.com", "currency":"eur", "amount_cents":1999, "customer_id":"c-1", "order_id":"o-1" }`).
		want(t, 200, `"key":"checkout:o-1"`, `"duplicate":true`)
	a.do(t, "POST", "/v1/checkouts", checkoutBody("o-1", 2000, "ann@example.com")).
		wantError(t, 422, `order_id: job "checkout:o-1" was already accepted with a different body`)
	a.do(t, "POST", "/v1/checkouts", checkoutBody("o-1", 1999, "bob@example.com")).
		wantError(t, 422, `order_id: job "checkout:o-1" was already accepted with a different body`)
	if n := a.intents(t, "checkout:o-1"); n != 1 {
		t.Fatalf("%d intents for checkout:o-1, want 1", n)
	}
	// A checkout and a charge of one order are two jobs.
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 1999)).want(t, 202, `"key":"charge:o-1"`)
	a.do(t, "GET", "/v1/jobs/checkout:o-1", "").want(t, 200, `"key":"checkout:o-1"`, `"status":"accepted"`, `"type":"order:checkout"`)

	ok := a.do(t, "POST", "/v1/checkouts", checkoutBody("o-2", 500, "ann@example.com"), "Idempotency-Key", "k-1").want(t, 202, `"key":"checkout:o-2"`)
	again := a.do(t, "POST", "/v1/checkouts", checkoutBody("o-2", 500, "ann@example.com"), "Idempotency-Key", "k-1").want(t, 202)
	if again.body != ok.body || again.header.Get(HeaderReplayed) != "true" {
		t.Fatalf("replay: %d %q (replayed %q), want %q", again.code, again.body, again.header.Get(HeaderReplayed), ok.body)
	}
	a.do(t, "POST", "/v1/checkouts", checkoutBody("o-3", 500, "ann@example.com"), "Idempotency-Key", "k-1").
		wantError(t, 422, `Idempotency-Key "k-1" was used with a different body`)
	if n := a.intents(t, "checkout:o-3"); n != 0 {
		t.Fatalf("a refused header reuse recorded %d intents for checkout:o-3", n)
	}
}

// TestCheckoutRefusals: an invalid checkout is 422 naming the field and records nothing;
// a bad email is never echoed back, and an order id that leaves no room for the step keys
// (checkout:<order_id>#s/receipt over 255 bytes) is refused naming order_id.
func TestCheckoutRefusals(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	room := idempotency.MaxKeyBytes - len("checkout:") - len("#s/receipt")
	for _, tc := range []struct {
		name, body, msg, secret string
	}{
		{"no at", checkoutBody("o-1", 5, "secret.person.example.com"), "email: must be local@domain", "secret.person"},
		{"two ats", checkoutBody("o-1", 5, "secret@person@example.com"), "email: must be local@domain", "secret@person"},
		{"space", checkoutBody("o-1", 5, "secret person@example.com"), "email: byte 6", "secret person"},
		{"non-ASCII", checkoutBody("o-1", 5, "sécret@example.com"), "email: byte 1", "cret@example"},
		{"too long", checkoutBody("o-1", 5, "secret@"+strings.Repeat("x", tasks.MaxEmailBytes)), "email: must be 1 to 254 bytes, got 261", "secret@xxx"},
		{"empty", checkoutBody("o-1", 5, ""), "email: must be 1 to 254 bytes, got 0", ""},
		{"missing", `{"order_id":"o-1","customer_id":"c-1","amount_cents":5,"currency":"EUR"}`, "email: must be 1 to 254 bytes", ""},
		{"order id too long for the step keys", checkoutBody(strings.Repeat("o", room+1), 5, "ann@example.com"), "order_id: 237 bytes; the limit is 236", ""},
		{"order id with #", checkoutBody("o#1", 5, "ann@example.com"), "order_id", ""},
		{"amount over the maximum", `{"order_id":"o-1","customer_id":"c-1","amount_cents":100000000000,"currency":"EUR","email":"ann@example.com"}`, "amount_cents: must be a positive whole number of cents, at most 99999999999", ""},
		{"bad currency", `{"order_id":"o-1","customer_id":"c-1","amount_cents":5,"currency":"EURO","email":"ann@example.com"}`, "currency: must be a three-letter ISO 4217 code", ""},
		{"unknown field", `{"order_id":"o-1","customer_id":"c-1","amount_cents":5,"currency":"EUR","email":"ann@example.com","to":"x"}`, "to: unknown field", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := a.do(t, "POST", "/v1/checkouts", tc.body)
			got.wantError(t, 422, tc.msg)
			if tc.secret != "" && strings.Contains(got.body, tc.secret) {
				t.Fatalf("the answer echoes the email: %s", got.body)
			}
		})
	}
	if n := a.intents(t, "checkout:o-1"); n != 0 {
		t.Fatalf("%d intents recorded by refused requests, want 0", n)
	}
	// The longest order id that leaves room for the step keys is accepted.
	a.do(t, "POST", "/v1/checkouts", checkoutBody(strings.Repeat("o", room), 5, "ann@example.com")).want(t, 202)
}
