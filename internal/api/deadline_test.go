package api

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	dto "github.com/prometheus/client_model/go"

	"github.com/idemq/idemq/internal/httpserver"
	"github.com/idemq/idemq/internal/testenv"
)

// lockIntents takes an ACCESS EXCLUSIVE lock on the test schema's job_intents in a
// connection of the test's own, as a stalled Postgres would look to the API: every
// statement on the table waits. The returned func releases it (also at the test's end).
func (a *testAPI) lockIntents(t *testing.T) (release func()) {
	t.Helper()
	ctx := testenv.Context(t, time.Minute)
	conn, err := pgx.ConnectConfig(ctx, a.pool.Config().ConnConfig.Copy())
	if err != nil {
		t.Fatal(err)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `LOCK TABLE job_intents IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	done := false
	release = func() {
		if !done {
			done = true
			tx.Rollback(context.Background())
			conn.Close(context.Background())
		}
	}
	t.Cleanup(release)
	return release
}

// count is the API's request counter for route and code.
func (a *testAPI) count(route, code string) float64 {
	var m dto.Metric
	if err := a.metrics.APIRequests.WithLabelValues(route, code).Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}

// waitCount waits until the counter for route and code reaches want.
func (a *testAPI) waitCount(t *testing.T, route, code string, want float64) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); a.count(route, code) < want; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s counted %s %v times, want %v (200: %v times)", route, code, a.count(route, code), want, a.count(route, "200"))
		}
	}
}

// TestStalledPostgresIs503: with the table the API writes locked, POST and GET answer 503
// with Retry-After within the request timeout instead of hanging, and nothing is left
// behind: once the lock is gone the same request is accepted.
func TestStalledPostgresIs503(t *testing.T) {
	t.Parallel()
	const timeout = time.Second
	a := newTestAPI(t, &Options{RequestTimeout: timeout})
	release := a.lockIntents(t)

	for _, tc := range []struct {
		name, method, path, body string
		headers                  []string
	}{
		{"POST", "POST", "/v1/charges", chargeBody("o-1", 5), nil},
		{"POST with Idempotency-Key", "POST", "/v1/charges", chargeBody("o-1", 5), []string{"Idempotency-Key", "k-1"}},
		{"GET", "GET", "/v1/jobs/charge:o-1", "", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			ans := a.do(t, tc.method, tc.path, tc.body, tc.headers...)
			took := time.Since(start)
			ans.wantError(t, 503, "timed out; retry later")
			if ans.header.Get("Retry-After") == "" {
				t.Fatalf("503 without Retry-After: %v", ans.header)
			}
			if took > timeout+2*time.Second {
				t.Fatalf("answered after %s; the request timeout is %s", took, timeout)
			}
		})
	}
	if n := a.count("POST /v1/charges", "503"); n != 2 {
		t.Fatalf("POST /v1/charges counted 503 %v times, want 2", n)
	}

	release()
	if n := a.intents(t, "charge:o-1"); n != 0 {
		t.Fatalf("%d intents recorded by requests that answered 503, want 0", n)
	}
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 5), "Idempotency-Key", "k-1").want(t, 202, `"key":"charge:o-1"`)
	a.do(t, "GET", "/v1/jobs/charge:o-1", "").want(t, 200, `"status":"accepted"`)
}

// TestClientGoneIs499: a request whose client hangs up before the answer is counted as
// 499, never as the implicit 200 that means "duplicate" in this API.
func TestClientGoneIs499(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)

	t.Run("POST", func(t *testing.T) {
		entered := make(chan struct{})
		a.s.holdAccept = func(ctx context.Context) {
			close(entered)
			<-ctx.Done() // the client hung up
		}
		defer func() { a.s.holdAccept = nil }()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			<-entered
			cancel()
		}()
		req, _ := http.NewRequestWithContext(ctx, "POST", a.URL+"/v1/charges", strings.NewReader(chargeBody("o-1", 5)))
		req.Header.Set("Content-Type", "application/json")
		if resp, err := a.Client().Do(req); !errors.Is(err, context.Canceled) {
			t.Fatalf("want the client's own cancellation, got %v %v", resp, err)
		}
		a.waitCount(t, "POST /v1/charges", "499", 1)
		if n := a.count("POST /v1/charges", "200"); n != 0 {
			t.Fatalf("a request whose client went away counted as 200 %v times", n)
		}
	})

	t.Run("GET", func(t *testing.T) {
		a.lockIntents(t) // the unknown key's intent lookup waits
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "GET", a.URL+"/v1/jobs/charge:unknown", nil)
		if resp, err := a.Client().Do(req); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("want the client's own timeout, got %v %v", resp, err)
		}
		a.waitCount(t, "GET /v1/jobs/{key...}", "499", 1)
		if n := a.count("GET /v1/jobs/{key...}", "200"); n != 0 {
			t.Fatalf("a request whose client went away counted as 200 %v times", n)
		}
	})
}

// TestSilentHandlerIs500: a handler that ends without writing gets its client a 500, not
// the implicit empty 200.
func TestSilentHandlerIs500(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	a.s.mux.HandleFunc("GET /v1/test/silent", func(http.ResponseWriter, *http.Request) {})
	a.do(t, "GET", "/v1/test/silent", "").wantError(t, 500, "internal error")
	if n := a.count("GET /v1/test/silent", "500"); n != 1 {
		t.Fatalf("counted as 500 %v times, want 1", n)
	}
}

// TestDashboardAndMetricsUnderServerTimeouts serves the API as `idemq api` does, through
// httpserver with its default timeouts: the dashboard, its largest script and /metrics
// still arrive whole.
func TestDashboardAndMetricsUnderServerTimeouts(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	ctx, cancel := context.WithCancel(context.Background())
	addrc, done := make(chan string, 1), make(chan error, 1)
	go func() {
		done <- httpserver.Serve(ctx, "127.0.0.1:0", a.s, slog.New(slog.DiscardHandler),
			&httpserver.Options{Ready: func(addr net.Addr) { addrc <- addr.String() }})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	base := "http://" + <-addrc
	get := func(path string) (int, string) {
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if resp.ContentLength >= 0 && int64(len(b)) != resp.ContentLength {
			t.Fatalf("%s: %d of %d bytes", path, len(b), resp.ContentLength)
		}
		return resp.StatusCode, string(b)
	}
	code, page := get("/monitoring/")
	scripts := regexp.MustCompile(`/monitoring/static/js/[^"]+\.js`).FindAllString(page, -1)
	if code != 200 || len(scripts) == 0 {
		t.Fatalf("/monitoring/: %d, scripts %v", code, scripts)
	}
	largest := 0
	for _, s := range scripts {
		code, body := get(s)
		if code != 200 {
			t.Fatalf("%s: %d", s, code)
		}
		largest = max(largest, len(body))
	}
	if largest < 500<<10 {
		t.Fatalf("the largest dashboard script is %d bytes; expected asynqmon's bundle (about 1 MB)", largest)
	}
	if code, body := get("/metrics"); code != 200 || !strings.Contains(body, "idemq_api_requests_total") {
		t.Fatalf("/metrics: %d", code)
	}
}
