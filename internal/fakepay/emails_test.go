package fakepay_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/fakepay"
	"github.com/idemq/idemq/internal/testenv"
)

func postEmail(t *testing.T, url, key, fence, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", url+"/v1/emails", bytes.NewBufferString(body))
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	if fence != "" {
		req.Header.Set("Idemq-Fence", fence)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// The email endpoint is a provider without idempotency: the same request with the same
// Idempotency-Key is sent, and stored, every time, with its key and fence.
func TestEmailsNeverHonourKeys(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	srv := httptest.NewServer(fakepay.New(pool, fakepay.Config{HonorKeys: true}))
	defer srv.Close()
	body := `{"to":"ann@example.com","subject":"Your receipt","order_id":"o-1"}`
	for i := range 2 {
		code, answer := postEmail(t, srv.URL, "checkout:o-1#s/receipt", "7", body)
		var e fakepay.Email
		if code != http.StatusAccepted || json.Unmarshal([]byte(answer), &e) != nil || e.ID == 0 || e.OrderID != "o-1" {
			t.Fatalf("send %d: %d %s, want 202 with the email's id", i+1, code, answer)
		}
	}
	var n, fenced int
	if err := pool.QueryRow(testenv.Context(t, 30*time.Second), `SELECT count(*), count(*) FILTER (WHERE fence = 7 AND idempotency_key = 'checkout:o-1#s/receipt'
		AND to_address = 'ann@example.com' AND subject = 'Your receipt') FROM fakepay_emails WHERE order_id = 'o-1'`).Scan(&n, &fenced); err != nil {
		t.Fatal(err)
	}
	if n != 2 || fenced != 2 {
		t.Fatalf("%d emails stored (%d with their key and fence), want 2: a key is recorded, never honoured", n, fenced)
	}
}

// A bad request is refused naming the field, stores nothing, and never quotes the address.
func TestEmailRequestsAreChecked(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	srv := httptest.NewServer(fakepay.New(pool, fakepay.Config{}))
	defer srv.Close()
	long := strings.Repeat("a", 250) + "@example.com"
	for _, c := range []struct{ body, want string }{
		{`{"to":"` + long + `","subject":"s","order_id":"o-1"}`, "to: must be 1 to 254 bytes"},
		{`{"to":"secret-person","subject":"s","order_id":"o-1"}`, "to: is not an email address"},
		{`{"to":"a@b.c","subject":"","order_id":"o-1"}`, "subject: must be 1 to 200 bytes"},
		{`{"to":"a@b.c","subject":"s","order_id":""}`, "order_id: must be"},
		{`{"to":"a@b.c","subject":"s","order_id":"o-1","bcc":"x@y.z"}`, "unknown field"},
	} {
		code, answer := postEmail(t, srv.URL, "", "", c.body)
		if code != http.StatusBadRequest || !strings.Contains(answer, c.want) {
			t.Errorf("%s: %d %s, want 400 naming %q", c.body, code, answer, c.want)
		}
		if strings.Contains(answer, "secret-person") {
			t.Errorf("the answer quotes the address: %s", answer)
		}
	}
	if code, _ := postEmail(t, srv.URL, "", "x", `{"to":"a@b.c","subject":"s","order_id":"o-1"}`); code != http.StatusBadRequest {
		t.Errorf("a bad Idemq-Fence header: %d, want 400", code)
	}
	var n int
	if err := pool.QueryRow(testenv.Context(t, 30*time.Second), `SELECT count(*) FROM fakepay_emails`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d emails stored after bad requests (%v), want 0", n, err)
	}
}

// The email endpoint records the key a caller sends in Idemq-Key (idemq's charger sends
// no Idempotency-Key to an endpoint that honours none, so that Go's transport never sends
// the request twice), and still the Idempotency-Key of an older caller; a bad or repeated
// Idemq-Key is refused naming the header, and two different keys are refused.
func TestEmailKeyHeaders(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	srv := httptest.NewServer(fakepay.New(pool, fakepay.Config{HonorKeys: true}))
	defer srv.Close()
	post := func(order string, h http.Header) (int, string) {
		req, _ := http.NewRequest("POST", srv.URL+"/v1/emails", strings.NewReader(`{"to":"ann@example.com","subject":"Your receipt","order_id":"`+order+`"}`))
		for k, vs := range h {
			req.Header[k] = vs
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for _, c := range []struct {
		order string
		h     http.Header
		code  int
		want  string // the stored key, or the error
	}{
		{"k-new", http.Header{"Idemq-Key": {"checkout:k-new#s/receipt"}, "Idemq-Fence": {"9"}}, http.StatusAccepted, "checkout:k-new#s/receipt"},
		{"k-old", http.Header{"Idempotency-Key": {"checkout:k-old#s/receipt"}}, http.StatusAccepted, "checkout:k-old#s/receipt"},
		{"k-both", http.Header{"Idemq-Key": {"checkout:k-both#s/receipt"}, "Idempotency-Key": {"checkout:k-both#s/receipt"}}, http.StatusAccepted, "checkout:k-both#s/receipt"},
		{"k-differ", http.Header{"Idemq-Key": {"checkout:a#s/receipt"}, "Idempotency-Key": {"checkout:b#s/receipt"}}, http.StatusBadRequest, "Idemq-Key and Idempotency-Key headers differ"},
		{"k-twice", http.Header{"Idemq-Key": {"a", "b"}}, http.StatusBadRequest, "Idemq-Key header: given 2 times"},
		{"k-bad", http.Header{"Idemq-Key": {"has space"}}, http.StatusBadRequest, "Idemq-Key header:"},
	} {
		code, answer := post(c.order, c.h)
		if code != c.code || (code != http.StatusAccepted && !strings.Contains(answer, c.want)) {
			t.Errorf("%s: %d %s, want %d (%s)", c.order, code, answer, c.code, c.want)
			continue
		}
		if code == http.StatusAccepted {
			var key string
			if err := pool.QueryRow(testenv.Context(t, 30*time.Second), `SELECT coalesce(idempotency_key, '') FROM fakepay_emails WHERE order_id = $1`, c.order).Scan(&key); err != nil || key != c.want {
				t.Errorf("%s: stored key %q (%v), want %q", c.order, key, err, c.want)
			}
		}
	}
}
