package api

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
)

// testToken and otherToken are API tokens of the form IDEMQ_API_TOKEN takes.
const (
	testToken  = "test-token-0123456789abcdefghijklmnopqrstuvwxyz"
	otherToken = "other.token_0123456789~ABCDEFGHIJKLMNOP+/="
)

// TestAPIRefusesBrowserForms: a POST to /v1/ whose body is not declared
// application/json (what an HTML form on any site can send without a CORS preflight) is
// 415 and records nothing, and a cross-origin POST is 403 whatever its type; JSON with
// parameters, and clients that send no browser headers (curl), are accepted.
func TestAPIRefusesBrowserForms(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	for _, path := range []string{"/v1/charges", "/v1/wallet/debits", "/v1/checkouts"} {
		body := chargeBody("o-1", 5)
		switch path {
		case "/v1/wallet/debits":
			body = `{"account_id":"a-1","amount_cents":5,"reference":"r-1"}`
		case "/v1/checkouts":
			body = checkoutBody("o-1", 5, "ann@example.com")
		}
		for _, ct := range []string{"", "text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
			"multipart/form-data; boundary=x", "application/jsonx", "text/json", "application/json, text/plain"} {
			ans := a.do(t, "POST", path, body, "Content-Type", ct)
			ans.wantError(t, 415, "Content-Type: must be application/json")
			if got := ans.header.Get("Accept-Post"); got != "application/json" {
				t.Errorf("%s %q: Accept-Post %q", path, ct, got)
			}
		}
		for _, h := range [][]string{
			{"Sec-Fetch-Site", "cross-site"},
			{"Sec-Fetch-Site", "same-site"},
			{"Origin", "http://evil.example"},
			{"Origin", "null"},
		} {
			a.do(t, "POST", path, body, h...).wantError(t, 403, "cross-origin request refused")
		}
	}
	if n := a.intents(t, "charge:o-1") + a.intents(t, "debit:r-1") + a.intents(t, "checkout:o-1"); n != 0 {
		t.Fatalf("%d intents recorded by refused requests, want 0", n)
	}
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 5), "Content-Type", "Application/JSON; charset=utf-8").want(t, 202)
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 5), "Origin", a.URL, "Sec-Fetch-Site", "same-origin").want(t, 200, `"duplicate":true`)
	// A cross-site read is not a write: the browser cannot read its answer anyway.
	a.do(t, "GET", "/v1/jobs/charge:o-1", "", "Sec-Fetch-Site", "cross-site").want(t, 200)
}

// TestAPITokens: with tokens, /v1/ admits a request only with one of them as a bearer
// token (either of two, for rotation) and answers 401 with a Bearer challenge otherwise;
// without a token and off loopback, /v1/ is 403 naming IDEMQ_API_TOKEN (the placeholder
// counts as none), while the health endpoints are served; on loopback it is open.
func TestAPITokens(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, &Options{ListenAddr: ":8080", APITokens: []string{testToken, otherToken}})
	if got := a.s.API(); got != AccessToken {
		t.Fatalf("API() = %v, want AccessToken", got)
	}
	for _, auth := range []string{"", "Bearer", "Bearer ", "Bearer " + testToken[1:], "Bearer " + testToken + "x", "Basic " + testToken,
		basic("", testToken), "Bearer " + testToken + "," + otherToken, "Bearer " + PlaceholderPassword} {
		for _, req := range [][3]string{{"POST", "/v1/charges", chargeBody("o-1", 5)}, {"POST", "/v1/checkouts", checkoutBody("o-1", 5, "ann@example.com")},
			{"GET", "/v1/jobs/charge:o-1", ""}, {"GET", "/v1/nope", ""}} {
			ans := a.do(t, req[0], req[1], req[2], "Authorization", auth)
			ans.wantError(t, 401, "IDEMQ_API_TOKEN")
			if got := ans.header.Get("WWW-Authenticate"); !strings.HasPrefix(got, "Bearer ") {
				t.Fatalf("%s %s with %q: WWW-Authenticate %q, want a Bearer challenge", req[0], req[1], auth, got)
			}
			if strings.Contains(ans.body, testToken) || strings.Contains(ans.body, otherToken) {
				t.Fatalf("the answer shows a token: %s", ans.body)
			}
		}
	}
	if n := a.intents(t, "charge:o-1"); n != 0 {
		t.Fatalf("%d intents recorded by unauthenticated requests, want 0", n)
	}
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 5), "Authorization", "Bearer "+testToken).want(t, 202)
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 5), "Authorization", "bearer "+otherToken).want(t, 200, `"duplicate":true`)
	a.do(t, "GET", "/v1/jobs/charge:o-1", "", "Authorization", "Bearer "+otherToken).want(t, 200, `"key":"charge:o-1"`)

	for _, tokens := range [][]string{nil, {PlaceholderPassword}, {""}} {
		b := newTestAPI(t, &Options{ListenAddr: "0.0.0.0:8080", APITokens: tokens})
		if got := b.s.API(); got != AccessRefused {
			t.Fatalf("tokens %q: API() = %v, want AccessRefused", tokens, got)
		}
		b.do(t, "POST", "/v1/charges", chargeBody("o-1", 5)).wantError(t, 403, "set IDEMQ_API_TOKEN")
		b.do(t, "POST", "/v1/charges", chargeBody("o-1", 5), "Authorization", "Bearer "+PlaceholderPassword).wantError(t, 403, "set IDEMQ_API_TOKEN")
		b.do(t, "GET", "/v1/jobs/charge:o-1", "").wantError(t, 403, "set IDEMQ_API_TOKEN")
		b.do(t, "GET", "/healthz", "").want(t, 200)
		if n := b.intents(t, "charge:o-1"); n != 0 {
			t.Fatalf("%d intents recorded by refused requests, want 0", n)
		}
	}

	c := newTestAPI(t, nil) // loopback
	if got := c.s.API(); got != AccessLoopback {
		t.Fatalf("API() = %v, want AccessLoopback", got)
	}
	c.do(t, "POST", "/v1/charges", chargeBody("o-1", 5)).want(t, 202)
}

// TestLoopbackModeAnswersOnlyLocalHosts: what is served without a password or token
// because the server listens on loopback answers 421 to a request whose Host is another
// name (a DNS-rebinding page is same-origin with it), and serves localhost and loopback
// literals with or without the port. With a password and a token the Host is not checked.
func TestLoopbackModeAnswersOnlyLocalHosts(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, &Options{DashboardActions: true})
	a.publish(t, "o-1")
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(a.URL, "http://"))
	type req struct{ method, path, body string }
	reqs := []req{
		{"GET", "/ledger/", ""}, {"GET", "/ledger/charge:o-1", ""}, {"GET", "/monitoring/", ""},
		{"GET", "/monitoring/api/queues/default/pending_tasks", ""}, {"POST", "/monitoring/api/queues/default:pause", ""},
		{"GET", "/v1/jobs/charge:o-1", ""}, {"POST", "/v1/charges", chargeBody("o-2", 5)},
	}
	for _, host := range []string{"rebind.evil.example:" + port, "rebind.evil.example", "localhost.evil.example:" + port,
		"127.0.0.1.nip.io:" + port, "192.168.1.5:" + port, "[::]:" + port, "0.0.0.0:" + port, "localhost.."} {
		for _, r := range reqs {
			a.do(t, r.method, r.path, r.body, "Host", host).wantError(t, 421, "misdirected request")
		}
	}
	a.do(t, "GET", "/monitoring/api/queues/default", "").want(t, 200, `"paused":false`)
	if n := a.intents(t, "charge:o-2"); n != 0 {
		t.Fatalf("%d intents recorded through a foreign Host, want 0", n)
	}
	for i, host := range []string{"localhost:" + port, "localhost", "LocalHost:" + port, "localhost.:" + port, "localhost.",
		"127.0.0.1:" + port, "127.0.0.1", "127.9.9.9:" + port, "[::1]:" + port, "[::1]"} {
		for _, r := range reqs[:len(reqs)-2] {
			if r.method == "GET" {
				a.do(t, r.method, r.path, r.body, "Host", host).want(t, 200)
			}
		}
		a.do(t, "GET", "/v1/jobs/charge:o-1", "", "Host", host).want(t, 200)
		a.do(t, "POST", "/v1/charges", chargeBody(fmt.Sprintf("o-local-%d", i), 5), "Host", host).want(t, 202)
	}

	// Guarded by a password and a token, any Host is served (to whoever has them).
	b := newTestAPI(t, &Options{DashboardUser: "ops", DashboardPassword: "s3cret", APITokens: []string{testToken}})
	b.do(t, "GET", "/ledger/", "", "Host", "idemq.example.com").wantError(t, 401, "authentication required")
	b.do(t, "GET", "/ledger/", "", "Host", "idemq.example.com", "Authorization", basic("ops", "s3cret")).want(t, 200)
	b.do(t, "GET", "/v1/jobs/charge:o-1", "", "Host", "idemq.example.com", "Authorization", "Bearer "+testToken).want(t, 404)
	// With a password but no token, only /v1/ checks the Host.
	c := newTestAPI(t, &Options{DashboardUser: "ops", DashboardPassword: "s3cret"})
	c.do(t, "GET", "/ledger/", "", "Host", "idemq.example.com", "Authorization", basic("ops", "s3cret")).want(t, 200)
	c.do(t, "GET", "/v1/jobs/charge:o-1", "", "Host", "idemq.example.com").wantError(t, 421, "misdirected request")
}

// TestAPIWrongMethodIs405: a known route asked with a method it does not take answers 405
// with Allow; an unknown route stays 404.
func TestAPIWrongMethodIs405(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	for _, tc := range []struct{ method, path, allow string }{
		{"GET", "/v1/charges", "POST"},
		{"PUT", "/v1/charges", "POST"},
		{"DELETE", "/v1/wallet/debits", "POST"},
		{"GET", "/v1/wallet/debits", "POST"},
		{"GET", "/v1/checkouts", "POST"},
		{"PUT", "/v1/checkouts", "POST"},
		{"POST", "/v1/jobs/charge:o-1", "GET, HEAD"},
		{"DELETE", "/v1/jobs/charge:o-1", "GET, HEAD"},
	} {
		ans := a.do(t, tc.method, tc.path, "")
		ans.wantError(t, 405, "not allowed")
		if got := ans.header.Get("Allow"); got != tc.allow {
			t.Errorf("%s %s: Allow %q, want %q", tc.method, tc.path, got, tc.allow)
		}
	}
	a.do(t, "GET", "/v1/nope", "").wantError(t, 404, "no route")
	a.do(t, "GET", "/v1/charges/x", "").wantError(t, 404, "no route")
	if n := a.count("/v1/charges", "405"); n != 2 {
		t.Errorf("/v1/charges counted 405 %v times, want 2", n)
	}
}

// TestGuardedAnswersAreNotStored: the answers of the ledger page, the dashboard and the
// API carry Cache-Control: no-store, so no browser or proxy cache keeps a payload or a
// result (nor a page served behind a password).
func TestGuardedAnswersAreNotStored(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, &Options{DashboardUser: "ops", DashboardPassword: "s3cret"})
	a.publish(t, "o-1")
	good := basic("ops", "s3cret")
	for _, ans := range []answer{
		a.do(t, "GET", "/ledger/", "", "Authorization", good).want(t, 200),
		a.do(t, "GET", "/ledger/charge:o-1", "", "Authorization", good).want(t, 200),
		a.do(t, "GET", "/ledger/", "").want(t, 401),
		a.do(t, "GET", "/monitoring/", "", "Authorization", good).want(t, 200),
		a.do(t, "GET", "/monitoring/api/queues/default/pending_tasks", "", "Authorization", good).want(t, 200),
		a.do(t, "GET", "/v1/jobs/charge:o-1", "").want(t, 200),
		a.do(t, "POST", "/v1/charges", chargeBody("o-2", 5)).want(t, 202),
		a.do(t, "GET", "/v1/jobs/charge:nope", "").want(t, 404),
	} {
		if got := ans.header.Get("Cache-Control"); got != "no-store" {
			t.Errorf("%d %.60s: Cache-Control %q, want no-store", ans.code, ans.body, got)
		}
	}
}

// TestExpectContinueOverLimitIs413: a POST whose Content-Length is over the body limit and
// that waits on Expect: 100-continue gets 413 at once, never 100 Continue, and the
// connection is closed.
func TestExpectContinueOverLimitIs413(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	for _, length := range []int64{DefaultMaxBodyBytes + 1, 1 << 40} {
		conn, err := net.Dial("tcp", a.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(30 * time.Second)) // against a hang only
		fmt.Fprintf(conn, "POST /v1/charges HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"+
			"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n", length)
		br := bufio.NewReader(conn)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			t.Fatalf("Content-Length %d with Expect: 100-continue: %s, want 413", length, resp.Status)
		}
		if !resp.Close {
			t.Errorf("Content-Length %d: the 413 keeps the connection open", length)
		}
		resp.Body.Close()
	}
	if n := a.intents(t, "charge:o-1"); n != 0 {
		t.Fatalf("%d intents, want 0", n)
	}
}

// TestLedgerPageUnavailableIs503: while Postgres is down the ledger page answers 503 with
// Retry-After, as the API does, not 500.
func TestLedgerPageUnavailableIs503(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	if err := testenv.Migrate(testenv.Context(t, time.Minute), pg.URL); err != nil {
		t.Fatal(err)
	}
	a := newTestAPIOn(t, testenv.Pool(t, pg.URL), nil)
	a.do(t, "GET", "/ledger/", "").want(t, 200)
	if err := pg.StopImmediate(); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{"/ledger/", "/ledger/charge:o-1", "/ledger/?status=completed", "/v1/jobs/charge:o-1"} {
		ans := a.do(t, "GET", path, "")
		ans.wantError(t, 503, "retry later")
		if ans.header.Get("Retry-After") == "" {
			t.Errorf("%s: 503 without Retry-After", path)
		}
	}
}
