package fakepay_test

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/fakepay"
	"github.com/idemq/idemq/internal/testenv"
)

// postRaw sends a charge request with the given Idempotency-Key header values (none when
// keys is nil) and returns the status and the "error" field of the answer.
func postRaw(t *testing.T, url string, keys []string, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", url+"/v1/charges", strings.NewReader(body))
	for _, k := range keys {
		req.Header.Add("Idempotency-Key", k)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q, want application/json (body %s)", ct, raw)
	}
	var e struct {
		Error string `json:"error"`
	}
	if err := json.Unmarshal(raw, &e); err != nil {
		t.Errorf("answer %q is not JSON: %v", raw, err)
	}
	return resp.StatusCode, e.Error
}

func TestInvalidIdempotencyKeyIsRefused(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	for _, honor := range []bool{true, false} {
		srv := httptest.NewServer(fakepay.New(pool, fakepay.Config{HonorKeys: honor}))
		for _, tc := range []struct {
			keys []string
			want string
		}{
			{[]string{"charge:o-\xff"}, "printable ASCII"},
			{[]string{strings.Repeat("k", 256)}, "255"},
			{[]string{"charge:o 1"}, "printable ASCII"},
			{[]string{"charge:o-1#r1"}, "'#'"},
			{[]string{"checkout:o-1#s/Charge"}, "step name"},
			{[]string{"checkout:o 1#s/charge"}, "invalid key"},
			{[]string{""}, "empty"},
			{[]string{"charge:o-1", "charge:o-2"}, "once"},
		} {
			code, msg := postRaw(t, srv.URL, tc.keys, order1)
			if code != http.StatusBadRequest || !strings.Contains(msg, "Idempotency-Key") || !strings.Contains(msg, tc.want) {
				t.Errorf("honor=%v key %q: %d %q, want 400 naming Idempotency-Key and %q", honor, tc.keys, code, msg, tc.want)
			}
			if strings.Contains(msg, "SQLSTATE") || strings.Contains(msg, "UTF8") {
				t.Errorf("honor=%v key %q: answer shows a Postgres error: %q", honor, tc.keys, msg)
			}
		}
		if code, msg := postRaw(t, srv.URL, []string{strings.Repeat("k", 255)}, order1); code != http.StatusCreated {
			t.Errorf("honor=%v: a 255-byte key: %d %q, want 201", honor, code, msg)
		}
		srv.Close()
	}
	var charges int
	pool.QueryRow(testenv.Context(t, 5*time.Second), `SELECT count(*) FROM fakepay_charges`).Scan(&charges)
	if charges != 2 {
		t.Fatalf("charges = %d, want 2 (only the valid keys)", charges)
	}
}

func TestInternalErrorsAreNotShown(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	var logs testenv.LogBuffer
	srv := httptest.NewServer(fakepay.New(pool, fakepay.Config{HonorKeys: true,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))}))
	defer srv.Close()
	// The test's own schema: the charges table is gone, so every charge fails inside Postgres.
	if _, err := pool.Exec(testenv.Context(t, 10*time.Second), `DROP TABLE fakepay_charges`); err != nil {
		t.Fatal(err)
	}
	for _, keys := range [][]string{{"charge:o-1"}, nil} {
		code, msg := postRaw(t, srv.URL, keys, order1)
		if code != http.StatusInternalServerError || msg != "internal error" {
			t.Errorf("key %q: %d %q, want 500 \"internal error\"", keys, code, msg)
		}
	}
	if !strings.Contains(logs.String(), "fakepay_charges") {
		t.Errorf("the cause was not logged:\n%s", logs.String())
	}
}

// An Idemq-Fence header that is not one fence is refused, naming the header; a valid one
// is recorded with the request.
func TestFenceHeader(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	srv := httptest.NewServer(fakepay.New(pool, fakepay.Config{HonorKeys: true}))
	defer srv.Close()
	post := func(fences ...string) (int, string) {
		req, _ := http.NewRequest("POST", srv.URL+"/v1/charges", strings.NewReader(order1))
		req.Header.Set("Idempotency-Key", "charge:o-1")
		for _, f := range fences {
			req.Header.Add("Idemq-Fence", f)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(raw)
	}
	for _, fences := range [][]string{{"x"}, {"-1"}, {"1", "2"}, {"99999999999999999999"}} {
		if code, body := post(fences...); code != http.StatusBadRequest || !strings.Contains(body, "Idemq-Fence") {
			t.Errorf("fence %q: %d %s, want 400 naming Idemq-Fence", fences, code, body)
		}
	}
	if code, body := post("42"); code != http.StatusCreated {
		t.Fatalf("fence 42: %d %s, want 201", code, body)
	}
	if n := testenv.Count(t, pool, `SELECT count(*) FROM fakepay_requests WHERE fence = 42 AND status_code = 201`); n != 1 {
		t.Fatalf("%d requests recorded with fence 42, want 1", n)
	}
}
