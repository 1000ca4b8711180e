package fakepay_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/fakepay"
	"github.com/idemq/idemq/internal/testenv"
)

func post(t *testing.T, url, key, body string) (int, fakepay.Charge) {
	t.Helper()
	req, _ := http.NewRequest("POST", url+"/v1/charges", bytes.NewBufferString(body))
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Error(err)
		return 0, fakepay.Charge{}
	}
	defer resp.Body.Close()
	var c fakepay.Charge
	json.NewDecoder(resp.Body).Decode(&c)
	return resp.StatusCode, c
}

const order1 = `{"order_id":"o-1","customer_id":"c-1","amount_cents":100,"currency":"EUR"}`

func TestHonoursKeysUnderConcurrency(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	srv := httptest.NewServer(fakepay.New(pool, fakepay.Config{HonorKeys: true, Delay: 50 * time.Millisecond}))
	defer srv.Close()

	const n = 20
	var wg sync.WaitGroup
	codes := make([]int, n)
	ids := make([]string, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			codes[i], _ = post(t, srv.URL, "charge:o-1", order1)
			_, c := post(t, srv.URL, "charge:o-1", order1) // after the first finished or while it runs
			ids[i] = c.ID
		}()
	}
	wg.Wait()
	// Settle: one more request surely sees the charge.
	code, c := post(t, srv.URL, "charge:o-1", order1)
	if code != http.StatusOK || !c.Replayed || c.ID == "" {
		t.Fatalf("repeat: %d %+v, want 200 replaying the charge", code, c)
	}
	created := 0
	for _, code := range codes {
		switch code {
		case http.StatusCreated:
			created++
		case http.StatusOK, http.StatusConflict:
		default:
			t.Errorf("unexpected status %d", code)
		}
	}
	var charges, requests int
	ctx := testenv.Context(t, 10*time.Second)
	pool.QueryRow(ctx, `SELECT count(*) FROM fakepay_charges WHERE order_id = 'o-1'`).Scan(&charges)
	pool.QueryRow(ctx, `SELECT count(*) FROM fakepay_requests WHERE idempotency_key = 'charge:o-1'`).Scan(&requests)
	if charges != 1 || created > 1 {
		t.Fatalf("charges = %d (201 answers %d), want exactly 1", charges, created)
	}
	if requests != 2*n+1 {
		t.Fatalf("recorded requests = %d, want %d", requests, 2*n+1)
	}
	for _, id := range ids {
		if id != "" && id != c.ID {
			t.Fatalf("a replay answered charge %s, want %s", id, c.ID)
		}
	}

	if code, _ := post(t, srv.URL, "charge:o-1", `{"order_id":"o-1","customer_id":"c-1","amount_cents":999,"currency":"EUR"}`); code != http.StatusBadRequest {
		t.Fatalf("key reused with another amount: %d, want 400", code)
	}
	if code, _ := post(t, srv.URL, "k", `{"order_id":"o-2"}`); code != http.StatusBadRequest {
		t.Fatalf("invalid body: %d, want 400", code)
	}
}

func TestWithoutHonouringKeysEveryRequestCharges(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	srv := httptest.NewServer(fakepay.New(pool, fakepay.Config{HonorKeys: false}))
	defer srv.Close()
	for range 3 {
		if code, _ := post(t, srv.URL, "charge:o-1", order1); code != http.StatusCreated {
			t.Fatalf("status %d, want 201", code)
		}
	}
	var charges int
	pool.QueryRow(testenv.Context(t, 5*time.Second), `SELECT count(*) FROM fakepay_charges`).Scan(&charges)
	if charges != 3 {
		t.Fatalf("charges = %d, want 3 (keys ignored)", charges)
	}
}
