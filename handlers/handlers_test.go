package handlers_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/handlers"
	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/fakepay"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

var charge = tasks.Charge{OrderID: "o-1", CustomerID: "c-1", AmountCents: 1999, Currency: "EUR"}

func TestChargeAgainstTheProvider(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	srv := httptest.NewServer(fakepay.New(pool, fakepay.Config{HonorKeys: true}))
	defer srv.Close()
	ch := handlers.NewCharger(srv.URL, nil)
	ctx := testenv.Context(t, 10*time.Second)

	first, err := ch.Charge(ctx, "charge:o-1", charge)
	if err != nil {
		t.Fatal(err)
	}
	again, err := ch.Charge(ctx, "charge:o-1", charge)
	if err != nil {
		t.Fatal(err)
	}
	var a, b handlers.ChargeResult
	json.Unmarshal(first, &a)
	json.Unmarshal(again, &b)
	if a.ChargeID == "" || a.ChargeID != b.ChargeID || a.Replayed || !b.Replayed || a.AmountCents != 1999 {
		t.Fatalf("first %+v, again %+v: want one charge, the second a replay", a, b)
	}
	// The provider refuses the key with other parameters: permanent.
	other := charge
	other.AmountCents = 5
	if _, err := ch.Charge(ctx, "charge:o-1", other); !errors.Is(err, asynq.SkipRetry) {
		t.Fatalf("key reused with another amount: %v, want a permanent error", err)
	}
}

func TestChargeMapsProviderAnswers(t *testing.T) {
	t.Parallel()
	var code int
	var body string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Idempotency-Key") != "charge:o-1" {
			t.Errorf("Idempotency-Key %q, want the job key", r.Header.Get("Idempotency-Key"))
		}
		w.WriteHeader(code)
		w.Write([]byte(body))
	}))
	defer srv.Close()
	ch := handlers.NewCharger(srv.URL+"/", nil)
	ctx := testenv.Context(t, 10*time.Second)
	for _, tc := range []struct {
		code      int
		body      string
		busy      bool
		permanent bool
		ok        bool
	}{
		{201, `{"id":"ch_1","amount_cents":1,"currency":"EUR"}`, false, false, true},
		{409, `{"error":"in flight"}`, true, false, false},
		{402, `{"error":"card declined"}`, false, true, false},
		{503, `unavailable`, false, false, false},
		{200, `{"no_id":true}`, false, false, false},
	} {
		code, body = tc.code, tc.body
		_, err := ch.Charge(ctx, "charge:o-1", charge)
		if tc.ok != (err == nil) || tc.busy != errors.Is(err, handlers.ErrProviderBusy) || tc.permanent != errors.Is(err, asynq.SkipRetry) {
			t.Errorf("provider answered %d %s: got %v; want ok=%v busy=%v permanent=%v", tc.code, tc.body, err, tc.ok, tc.busy, tc.permanent)
		}
	}
	if _, err := handlers.NewCharger("http://127.0.0.1:1", nil).Charge(ctx, "charge:o-1", charge); err == nil || errors.Is(err, asynq.SkipRetry) {
		t.Fatalf("unreachable provider: %v, want a retryable error", err)
	}
}

func TestDebitWritesOneEntryInTheLedgersTransaction(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ledger := idempotency.New(pool, nil)
	defer ledger.Close()
	ctx := testenv.Context(t, 10*time.Second)
	d := tasks.Debit{AccountID: "a-1", AmountCents: 250, Reference: "r-1"}
	req := idempotency.Request{Key: d.Key(), TaskType: tasks.TypeDebit}
	res, err := ledger.DoTx(ctx, req, func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) { return handlers.Debit(ctx, tx, d) })
	if err != nil {
		t.Fatal(err)
	}
	var got handlers.DebitResult
	if err := json.Unmarshal(res.Result, &got); err != nil {
		t.Fatal(err)
	}
	var id, fence int64
	if err := pool.QueryRow(ctx, `SELECT id, fence FROM wallet_entries WHERE reference = 'r-1'`).Scan(&id, &fence); err != nil {
		t.Fatal(err)
	}
	if got.EntryID != id || got.Fence != res.Fence || fence != res.Fence || got.AmountCents != 250 {
		t.Fatalf("result %+v, entry %d with fence %d, claim fence %d", got, id, fence, res.Fence)
	}
	// Outside the ledger there is no fence: Debit refuses to run.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := handlers.Debit(ctx, tx, d); err == nil {
		t.Fatal("Debit ran outside the ledger")
	}
}
