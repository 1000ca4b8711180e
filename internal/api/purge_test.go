package api

import (
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
)

func TestPurgeKeys(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 5), "Idempotency-Key", "old").want(t, 202)
	a.do(t, "POST", "/v1/charges", chargeBody("o-2", 5), "Idempotency-Key", "new").want(t, 202)
	ctx := testenv.Context(t, 30*time.Second)
	if _, err := a.pool.Exec(ctx, `UPDATE api_idempotency_keys SET created_at = now() - interval '25 hours' WHERE header_key = 'old'`); err != nil {
		t.Fatal(err)
	}
	n, err := a.s.PurgeKeys(ctx, 24*time.Hour)
	if err != nil || n != 1 {
		t.Fatalf("PurgeKeys = %d, %v; want 1", n, err)
	}
	// Its one statement is in the purge's metrics, under its table.
	a.do(t, "GET", "/metrics", "").want(t, 200,
		"\nidemq_purge_rows_total{table=\"api_idempotency_keys\"} 1\n", "\nidemq_purge_seconds_count 1\n")
	// The purged key is a new request now: the job key still dedups it.
	ans := a.do(t, "POST", "/v1/charges", chargeBody("o-1", 5), "Idempotency-Key", "old").want(t, 200, `"duplicate":true`)
	if ans.header.Get(HeaderReplayed) != "" {
		t.Fatal("a purged key was replayed")
	}
	a.do(t, "POST", "/v1/charges", chargeBody("o-2", 5), "Idempotency-Key", "new").want(t, 202)
	if got := a.intents(t, "charge:o-1"); got != 1 {
		t.Fatalf("%d intents for charge:o-1, want 1", got)
	}
}
