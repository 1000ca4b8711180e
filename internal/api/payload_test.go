package api

import (
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
)

func TestDuplicateAndCaseVariantFieldsAreRefused(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	for _, tc := range []struct {
		name, path, body, msg string
	}{
		{"case variant beside the field", "/v1/wallet/debits", `{"account_id":"a","amount_cents":1,"reference":"dup2","REFERENCE":"dup3"}`, `REFERENCE: field names are case-sensitive (did you mean "reference"?)`},
		{"case variant alone", "/v1/wallet/debits", `{"account_id":"a","amount_cents":1,"Reference":"dup3"}`, `Reference: field names are case-sensitive`},
		{"folded long s", "/v1/charges", `{"order_id":"dup2","cuſtomer_id":"c","amount_cents":1,"currency":"EUR"}`, `cuſtomer_id: field names are case-sensitive (did you mean "customer_id"?)`},
		{"duplicate", "/v1/wallet/debits", `{"account_id":"a","amount_cents":1,"reference":"dup2","reference":"dup3"}`, `reference: duplicate field`},
		{"escaped duplicate", "/v1/charges", `{"order_id":"dup2","customer_id":"c","amount_cents":1,"currency":"EUR","\u006frder_id":"dup3"}`, `order_id: duplicate field`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a.do(t, "POST", tc.path, tc.body).wantError(t, 400, tc.msg)
		})
	}
	for _, key := range []string{"debit:dup2", "debit:dup3", "charge:dup2", "charge:dup3"} {
		if n := a.intents(t, key); n != 0 {
			t.Errorf("%d intents for %s recorded by refused requests, want 0", n, key)
		}
	}
	// A value that spells a field name is only a value.
	a.do(t, "POST", "/v1/wallet/debits", `{"account_id":"REFERENCE","amount_cents":1,"reference":"reference"}`).
		want(t, 202, `"key":"debit:reference"`)
}

func TestCurrencyCaseIsOneJob(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	body := func(cur string) string {
		return `{"order_id":"o-cur","customer_id":"c-1","amount_cents":1999,"currency":"` + cur + `"}`
	}
	a.do(t, "POST", "/v1/charges", body("usd")).want(t, 202, `"key":"charge:o-cur"`, `"duplicate":false`)
	a.do(t, "POST", "/v1/charges", body("USD")).want(t, 200, `"key":"charge:o-cur"`, `"duplicate":true`)
	a.do(t, "POST", "/v1/charges", body("uSd")).want(t, 200, `"duplicate":true`)
	if n := a.intents(t, "charge:o-cur"); n != 1 {
		t.Fatalf("%d intents for charge:o-cur, want 1", n)
	}
	var payload string
	if err := a.pool.QueryRow(testenv.Context(t, 10*time.Second), `SELECT convert_from(payload, 'UTF8') FROM job_intents WHERE idempotency_key = 'charge:o-cur'`).Scan(&payload); err != nil {
		t.Fatal(err)
	}
	if want := `{"order_id":"o-cur","customer_id":"c-1","amount_cents":1999,"currency":"USD"}`; payload != want {
		t.Fatalf("stored payload %s, want %s", payload, want)
	}

	// With an Idempotency-Key, the two spellings are one body: a replay, not a 422.
	first := a.do(t, "POST", "/v1/charges", `{"order_id":"o-cur2","customer_id":"c-1","amount_cents":5,"currency":"eur"}`, HeaderIdempotencyKey, "k-cur").
		want(t, 202, `"key":"charge:o-cur2"`)
	again := a.do(t, "POST", "/v1/charges", `{"order_id":"o-cur2","customer_id":"c-1","amount_cents":5,"currency":"EUR"}`, HeaderIdempotencyKey, "k-cur").
		want(t, 202)
	if again.body != first.body || again.header.Get(HeaderReplayed) != "true" {
		t.Fatalf("replay: %d %q (replayed %q), want %q", again.code, again.body, again.header.Get(HeaderReplayed), first.body)
	}
}
