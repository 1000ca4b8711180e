package asynqmw_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testledger"
)

// newLedger is testledger.New.
var newLedger = testledger.New

func get(t testing.TB, l *idempotency.Ledger, key string) *idempotency.Record {
	t.Helper()
	r, err := l.Get(context.Background(), key)
	if err != nil {
		t.Fatalf("Get(%q): %v", key, err)
	}
	return r
}

func jsonEqual(a, b json.RawMessage) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	return fmt.Sprint(x) == fmt.Sprint(y)
}
