package tasks_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"strings"
	"testing"

	"github.com/idemq/idemq/tasks"
)

// fingerprint is the ledger's payload fingerprint (idempotency.Fingerprint, which this
// package may not import): sha256(task type || 0x00 || canonical payload).
func fingerprint(typ string, payload []byte) []byte {
	h := sha256.New()
	h.Write([]byte(typ))
	h.Write([]byte{0})
	h.Write(payload)
	return h.Sum(nil)
}

// encoding/json matches field names case-insensitively, with Unicode simple folding (ſ is
// an s, the Kelvin sign a k), and lets a later duplicate win: the decoders must not.
func TestDecodeRefusesDuplicateAndCaseVariantFields(t *testing.T) {
	t.Parallel()
	decoders := map[string]func([]byte) error{
		tasks.TypeCharge: func(b []byte) error { _, err := tasks.DecodeCharge(b); return err },
		tasks.TypeDebit:  func(b []byte) error { _, err := tasks.DecodeDebit(b); return err },
	}
	for _, tc := range []struct {
		name, typ, payload, wantErr string
	}{
		{"upper-case variant", tasks.TypeDebit, `{"account_id":"a","amount_cents":1,"reference":"dup2","REFERENCE":"dup3"}`, `REFERENCE: field names are case-sensitive (did you mean "reference"?)`},
		{"upper-case variant alone", tasks.TypeDebit, `{"account_id":"a","amount_cents":1,"REFERENCE":"dup3"}`, `REFERENCE: field names are case-sensitive`},
		{"capitalised variant", tasks.TypeDebit, `{"account_id":"a","amount_cents":1,"Reference":"r"}`, `Reference: field names are case-sensitive (did you mean "reference"?)`},
		{"variant first", tasks.TypeCharge, `{"Order_ID":"o","order_id":"o","customer_id":"c","amount_cents":1,"currency":"EUR"}`, `Order_ID: field names are case-sensitive (did you mean "order_id"?)`},
		{"long s folds to s", tasks.TypeDebit, `{"account_id":"a","amount_centſ":1,"reference":"r"}`, `amount_centſ: field names are case-sensitive (did you mean "amount_cents"?)`},
		{"long s in charge", tasks.TypeCharge, `{"order_id":"o","cuſtomer_id":"c","amount_cents":1,"currency":"EUR"}`, `cuſtomer_id: field names are case-sensitive (did you mean "customer_id"?)`},
		{"duplicate", tasks.TypeDebit, `{"account_id":"a","amount_cents":1,"reference":"dup2","reference":"dup3"}`, `reference: duplicate field`},
		{"duplicate charge field", tasks.TypeCharge, `{"order_id":"o","customer_id":"c","amount_cents":1,"currency":"EUR","currency":"USD"}`, `currency: duplicate field`},
		{"escaped duplicate", tasks.TypeDebit, `{"account_id":"a","amount_cents":1,"reference":"dup2","\u0072eference":"dup3"}`, `reference: duplicate field`},
		{"duplicate unknown field", tasks.TypeDebit, `{"account_id":"a","amount_cents":1,"reference":"r","x":1,"x":2}`, `x: duplicate field`},
		// Not a fold of any name: the decoder's unknown-field rule answers, as before.
		{"long s for c is unknown", tasks.TypeDebit, `{"account_id":"a","amount_cents":1,"referenſe":"r"}`, `unknown field "referenſe"`},
		// Nested values are the decoder's: a duplicate inside one is not a top-level field.
		{"nested duplicate", tasks.TypeDebit, `{"account_id":"a","amount_cents":1,"reference":"r","x":{"a":1,"a":2,"REFERENCE":3}}`, `unknown field "x"`},
		{"nested in a known field", tasks.TypeDebit, `{"account_id":"a","amount_cents":1,"reference":{"reference":1,"reference":2}}`, `malformed payload`},
		// Malformed JSON keeps its own error.
		{"malformed after a duplicate-looking key", tasks.TypeDebit, `{"reference":"a","reference":`, `malformed payload`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := decoders[tc.typ]([]byte(tc.payload))
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("%s %s: got error %v, want one containing %q", tc.typ, tc.payload, err, tc.wantErr)
			}
		})
	}

	// Values that look like field names are values.
	d, err := tasks.DecodeDebit([]byte(`{"account_id":"REFERENCE","amount_cents":1,"reference":"reference"}`))
	if err != nil {
		t.Fatalf("names as values: %v", err)
	}
	if got, want := d, (tasks.Debit{AccountID: "REFERENCE", AmountCents: 1, Reference: "reference"}); got != want {
		t.Fatalf("got %+v, want %+v", got, want)
	}
}

// Currency codes are case-insensitive: every spelling of one code is one job, with one
// payload and one fingerprint, whether built by a constructor or decoded by the worker.
func TestCurrencyIsCaseInsensitiveAndCanonical(t *testing.T) {
	t.Parallel()
	want, err := tasks.ChargeSpec(tasks.Charge{OrderID: "o-1", CustomerID: "c-1", AmountCents: 1999, Currency: "USD"})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(want.Payload, []byte(`"currency":"USD"`)) {
		t.Fatalf("payload %s, want currency USD", want.Payload)
	}
	wantFP := fingerprint(want.Type, want.Payload)
	for _, cur := range []string{"USD", "usd", "Usd", "uSd"} {
		c := tasks.Charge{OrderID: "o-1", CustomerID: "c-1", AmountCents: 1999, Currency: cur}
		if err := c.Validate(); err != nil {
			t.Errorf("Validate(%q): %v", cur, err)
		}
		spec, err := tasks.ChargeSpec(c)
		if err != nil {
			t.Fatalf("ChargeSpec(%q): %v", cur, err)
		}
		if !bytes.Equal(spec.Payload, want.Payload) {
			t.Errorf("ChargeSpec(%q).Payload = %s, want %s", cur, spec.Payload, want.Payload)
		}
		task, err := tasks.NewChargeTask(c)
		if err != nil {
			t.Fatalf("NewChargeTask(%q): %v", cur, err)
		}
		if !bytes.Equal(task.Payload(), want.Payload) {
			t.Errorf("NewChargeTask(%q).Payload = %s, want %s", cur, task.Payload(), want.Payload)
		}

		// What the worker does with a hand-written payload: decode, then fingerprint
		// json.Marshal of the decoded value.
		decoded, err := tasks.DecodeCharge([]byte(`{"order_id":"o-1","customer_id":"c-1","amount_cents":1999,"currency":"` + cur + `"}`))
		if err != nil {
			t.Fatalf("DecodeCharge(%q): %v", cur, err)
		}
		if decoded.Currency != "USD" {
			t.Errorf("DecodeCharge(%q).Currency = %q, want USD", cur, decoded.Currency)
		}
		canonical, _ := json.Marshal(decoded)
		if got := fingerprint(tasks.TypeCharge, canonical); !bytes.Equal(got, wantFP) {
			t.Errorf("worker fingerprint of %q = %x, want %x (the constructor's)", cur, got, wantFP)
		}
	}

	for _, cur := range []string{"", "US", "USDD", "U$D", "ÜSD", "uſd", "US1", "usd "} {
		c := tasks.Charge{OrderID: "o-1", CustomerID: "c-1", AmountCents: 1, Currency: cur}
		if err := c.Validate(); err == nil || !strings.HasPrefix(err.Error(), "currency: ") {
			t.Errorf("Validate(%q) = %v, want a currency error", cur, err)
		}
		if _, err := tasks.ChargeSpec(c); err == nil || !strings.Contains(err.Error(), "currency: ") {
			t.Errorf("ChargeSpec(%q) = %v, want a currency error", cur, err)
		}
		b, _ := json.Marshal(c)
		if _, err := tasks.DecodeCharge(b); err == nil || !strings.Contains(err.Error(), "currency: ") {
			t.Errorf("DecodeCharge(%s) = %v, want a currency error", b, err)
		}
	}
}
