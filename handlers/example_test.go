package handlers_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/handlers"
	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// Debit runs inside the ledger's transaction (asynqmw.Transactional puts it there; here
// Ledger.DoTx does): its wallet entry and the job's completion commit together, so a
// second delivery gets the stored result and writes no second entry.
func ExampleDebit() {
	ctx := context.Background()
	pool, cleanup := testenv.ExamplePostgres(true) // a schema of its own, with wallet_entries
	defer cleanup()
	ledger := idempotency.New(pool, nil)
	defer ledger.Close()

	d := tasks.Debit{AccountID: "acct-1", AmountCents: 500, Reference: "ref-42"}
	payload, _ := json.Marshal(d)
	req := idempotency.Request{Key: d.Key(), TaskType: tasks.TypeDebit,
		Fingerprint: idempotency.Fingerprint(tasks.TypeDebit, payload)}
	for delivery := 1; delivery <= 2; delivery++ {
		res, err := ledger.DoTx(ctx, req, func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			return handlers.Debit(ctx, tx, d)
		})
		if err != nil {
			fmt.Println(err)
			return
		}
		var entry handlers.DebitResult
		json.Unmarshal(res.Result, &entry)
		fmt.Printf("delivery %d: cached=%t entry of %d cents for %s, fenced: %t\n",
			delivery, res.Cached, entry.AmountCents, entry.Reference, entry.Fence > 0)
	}
	var entries int
	pool.QueryRow(ctx, `SELECT count(*) FROM wallet_entries WHERE reference = 'ref-42'`).Scan(&entries)
	fmt.Println("wallet entries:", entries)
	// Output:
	// delivery 1: cached=false entry of 500 cents for ref-42, fenced: true
	// delivery 2: cached=true entry of 500 cents for ref-42, fenced: true
	// wallet entries: 1
}

// The provider sees the job's key as the Idempotency-Key: a repeated call (a retry after
// a crash between the call and the completion) gets the first charge back, not a second
// one. A refusal is permanent: the error wraps asynq.SkipRetry.
func ExampleCharger_Charge() {
	provider := httptest.NewServer(fakeProvider())
	defer provider.Close()
	charger := handlers.NewCharger(provider.URL, nil)
	ctx := context.Background()

	c := tasks.Charge{OrderID: "123", CustomerID: "42", AmountCents: 1999, Currency: "EUR"}
	for range 2 {
		res, err := charger.Charge(ctx, c.Key(), c)
		fmt.Printf("%s %v\n", res, err)
	}

	declined := tasks.Charge{OrderID: "124", CustomerID: "42", AmountCents: 1, Currency: "EUR"}
	_, err := charger.Charge(ctx, declined.Key(), declined)
	fmt.Println("retry?", !errors.Is(err, asynq.SkipRetry))
	// Output:
	// {"charge_id":"ch_1","amount_cents":1999,"currency":"EUR","replayed":false} <nil>
	// {"charge_id":"ch_1","amount_cents":1999,"currency":"EUR","replayed":true} <nil>
	// retry? false
}

// fakeProvider is a payment provider that honours Idempotency-Key and declines
// amounts under 50 cents.
func fakeProvider() http.Handler {
	var mu sync.Mutex
	charges := map[string]string{} // idempotency key → charge id
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var c tasks.Charge
		if err := json.NewDecoder(r.Body).Decode(&c); err != nil || c.AmountCents < 50 {
			http.Error(w, `{"error":"card_declined"}`, http.StatusPaymentRequired)
			return
		}
		mu.Lock()
		defer mu.Unlock()
		key := r.Header.Get("Idempotency-Key")
		id, replayed := charges[key]
		if !replayed {
			id = fmt.Sprintf("ch_%d", len(charges)+1)
			charges[key] = id
		}
		json.NewEncoder(w).Encode(map[string]any{"id": id, "amount_cents": c.AmountCents, "currency": c.Currency, "replayed": replayed})
	})
}
