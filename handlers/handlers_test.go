package handlers_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
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

func chargeRequest(key string) idempotency.Request {
	return idempotency.Request{Key: key, TaskType: tasks.TypeCharge, Fingerprint: idempotency.Fingerprint(tasks.TypeCharge, []byte(key))}
}

// Under a lease the charger sends its claim's fence, which the provider records with the
// request.
func TestChargeSendsItsFence(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	srv := httptest.NewServer(fakepay.New(pool, fakepay.Config{HonorKeys: true}))
	defer srv.Close()
	ctx := testenv.Context(t, 30*time.Second)
	l := idempotency.New(pool, nil)
	defer l.Close()
	ch := handlers.NewCharger(srv.URL, nil).WithFenceMargin(l.SelfFenceMargin())
	res, err := l.Do(ctx, chargeRequest("charge:o-1"), func(ctx context.Context) (json.RawMessage, error) {
		return ch.Charge(ctx, "charge:o-1", charge)
	})
	if err != nil {
		t.Fatal(err)
	}
	var fence *int64
	if err := pool.QueryRow(ctx, `SELECT fence FROM fakepay_requests WHERE idempotency_key = 'charge:o-1'`).Scan(&fence); err != nil {
		t.Fatal(err)
	}
	if fence == nil || *fence != res.Fence {
		t.Fatalf("recorded fence %v, want the claim's %d", fence, res.Fence)
	}
	// Outside a lease there is no fence to send.
	if _, err := ch.Charge(ctx, "charge:o-2", tasks.Charge{OrderID: "o-2", CustomerID: "c-1", AmountCents: 1, Currency: "EUR"}); err != nil {
		t.Fatal(err)
	}
	if n := testenv.Count(t, pool, `SELECT count(*) FROM fakepay_requests WHERE idempotency_key = 'charge:o-2' AND fence IS NULL`); n != 1 {
		t.Fatalf("%d requests of charge:o-2 without a fence, want 1", n)
	}
}

// Under a lease a call's deadline ends the fence margin before the self-fence deadline,
// and with too little of the lease left the charger does not call at all.
func TestChargeKeepsInsideTheLease(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	calls := make(chan struct{}, 10)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls <- struct{}{}
		io.Copy(io.Discard, r.Body) // then the server sees the client hang up
		<-r.Context().Done()        // a provider that never answers
	}))
	defer srv.Close()
	ctx := testenv.Context(t, 30*time.Second)
	const lease, margin = 3 * time.Second, 300 * time.Millisecond
	l := idempotency.New(pool, &idempotency.Config{Lease: lease, SelfFenceMargin: margin})
	defer l.Close()

	// Heartbeats keep moving the self-fence deadline; the call's own deadline, set when it
	// started, ends it while the handler still holds its lease.
	ch := handlers.NewCharger(srv.URL, nil).WithFenceMargin(time.Second)
	var live bool
	_, err := l.Do(ctx, chargeRequest("charge:slow"), func(fctx context.Context) (json.RawMessage, error) {
		out, err := ch.Charge(fctx, "charge:slow", charge)
		live = fctx.Err() == nil
		return out, err
	})
	if !errors.Is(err, context.DeadlineExceeded) || !live || len(calls) != 1 {
		t.Fatalf("Do: %v (handler live after the call: %t, %d calls); want the call's deadline, inside the lease", err, live, len(calls))
	}

	// A margin as long as the lease leaves no time to call.
	ch = handlers.NewCharger(srv.URL, nil).WithFenceMargin(lease)
	_, err = l.Do(ctx, chargeRequest("charge:late"), func(fctx context.Context) (json.RawMessage, error) {
		return ch.Charge(fctx, "charge:late", charge)
	})
	if !errors.Is(err, handlers.ErrLeaseEnding) || errors.Is(err, asynq.SkipRetry) || len(calls) != 1 {
		t.Fatalf("Do: %v (%d calls); want ErrLeaseEnding, retryable, without a call", err, len(calls))
	}
}
