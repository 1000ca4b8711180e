package handlers_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemq/idemq/handlers"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// dropSecond is a provider that answers a path's first request, reads the second one's
// body and then drops its connection without an answer, and answers every later one. It
// counts the requests of each path and keeps the headers of the last one.
type dropSecond struct {
	mu     sync.Mutex
	seen   map[string]int
	header map[string]http.Header
	answer map[string]string
}

func (d *dropSecond) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	io.ReadAll(r.Body)
	d.mu.Lock()
	d.seen[r.URL.Path]++
	n := d.seen[r.URL.Path]
	d.header[r.URL.Path] = r.Header.Clone()
	d.mu.Unlock()
	if n == 2 {
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			conn.Close()
		}
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusAccepted)
	io.WriteString(w, d.answer[r.URL.Path])
}

func (d *dropSecond) count(path string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.seen[path]
}

// A connection that breaks after the provider read a call's request is not a reason for
// Go's transport to send the request again on its own (it would, for a POST carrying
// Idempotency-Key, on a reused keep-alive connection): a receipt, which its endpoint does
// not deduplicate, would go out twice under one claim. The call fails instead, and the
// job's retry decides. The charge, whose provider honours its key, is held to the same
// rule: one call, at most one request that may have reached the provider.
func TestCallsAreNotResentOnABrokenConnection(t *testing.T) {
	t.Parallel()
	d := &dropSecond{seen: map[string]int{}, header: map[string]http.Header{}, answer: map[string]string{
		"/v1/emails":  `{"id":1,"order_id":"o-1"}`,
		"/v1/charges": `{"id":"ch_1","amount_cents":1999,"currency":"EUR"}`,
	}}
	srv := httptest.NewServer(d)
	defer srv.Close()
	ch := handlers.NewCharger(srv.URL, nil)
	ctx := testenv.Context(t, 30*time.Second)
	checkout := tasks.Checkout{OrderID: "o-1", CustomerID: "c-1", AmountCents: 1999, Currency: "EUR", Email: "ann@example.com"}

	// The first call of each kind leaves a keep-alive connection; the second is sent on it
	// and its connection dropped once the provider has read it.
	if _, err := ch.SendReceipt(ctx, "checkout:o-1#s/receipt", checkout); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.SendReceipt(ctx, "checkout:o-1#s/receipt", checkout); err == nil {
		t.Errorf("the receipt whose connection broke after it was read: no error, want one (the job's retry decides)")
	}
	if n := d.count("/v1/emails"); n != 2 {
		t.Errorf("the provider received %d email requests for two calls, want 2: the broken one was sent again", n)
	}
	if h := d.header["/v1/emails"]; h.Get("Idempotency-Key") != "" || h.Get(handlers.HeaderKey) != "checkout:o-1#s/receipt" {
		t.Errorf("email headers Idempotency-Key %q, %s %q; want no Idempotency-Key (the endpoint honours none) and the key in %s",
			h.Get("Idempotency-Key"), handlers.HeaderKey, h.Get(handlers.HeaderKey), handlers.HeaderKey)
	}

	if _, err := ch.Charge(ctx, "charge:o-1", charge); err != nil {
		t.Fatal(err)
	}
	_, err := ch.Charge(ctx, "charge:o-1", charge)
	if err == nil || !strings.Contains(err.Error(), "charge charge:o-1") {
		t.Errorf("the charge whose connection broke after it was read: %v, want an error naming the call", err)
	}
	if n := d.count("/v1/charges"); n != 2 {
		t.Errorf("the provider received %d charge requests for two calls, want 2: the broken one was sent again", n)
	}
	if h := d.header["/v1/charges"]; h.Get("Idempotency-Key") != "charge:o-1" {
		t.Errorf("charge Idempotency-Key %q, want charge:o-1", h.Get("Idempotency-Key"))
	}
}
