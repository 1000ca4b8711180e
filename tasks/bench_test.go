package tasks_test

import (
	"testing"

	"github.com/idemq/idemq/tasks"
)

// The decoders run once per delivery: these measure a valid payload, the common case.
func BenchmarkDecodeDebit(b *testing.B) {
	payload := []byte(`{"account_id":"acct-000417","amount_cents":2500,"reference":"ref-2f9c6a1e-0b7d-4c55-9a3e-55d0c1f0a9b2"}`)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := tasks.DecodeDebit(payload); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDecodeCharge(b *testing.B) {
	payload := []byte(`{"order_id":"ord-88213","customer_id":"cust-4471","amount_cents":1999,"currency":"eur"}`)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := tasks.DecodeCharge(payload); err != nil {
			b.Fatal(err)
		}
	}
}
