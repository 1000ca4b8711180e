package api

import (
	"net/http"
	"testing"
)

// '#' is reserved for republished tasks' TaskIDs (key#r<n>): a field that becomes part of
// a key may not hold one, and the API says which field.
func TestFieldsWithHashAreRefused(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	a.do(t, "POST", "/v1/wallet/debits", `{"account_id":"a-1","amount_cents":5,"reference":"victim#r1"}`).
		wantError(t, http.StatusUnprocessableEntity, "reference")
	a.do(t, "POST", "/v1/charges", `{"order_id":"o#r2","customer_id":"c-1","amount_cents":5,"currency":"EUR"}`).
		wantError(t, http.StatusUnprocessableEntity, "order_id")
	var n int
	if err := a.pool.QueryRow(t.Context(), `SELECT count(*) FROM job_intents`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("intents recorded: %d %v; want none", n, err)
	}
}
