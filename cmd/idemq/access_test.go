package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
)

// API tokens of the form IDEMQ_API_TOKEN takes.
const (
	tokenA = "tokenA-0123456789abcdefghijklmnopqrstuvwxyz"
	tokenB = "tokenB-0123456789abcdefghijklmnopqrstuvwxyz"
)

// bearerTransport sends token as the bearer token of every request.
type bearerTransport string

func (b bearerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+string(b))
	return http.DefaultTransport.RoundTrip(r)
}

// call sends one request to the process; headers are name, value pairs (Host sets the
// request's). It returns the status and the body.
func (a *apiProc) call(t *testing.T, method, path, body string, headers ...string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(testenv.Context(t, 30*time.Second), method, a.base+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		if headers[i] == "Host" {
			req.Host = headers[i+1]
			continue
		}
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

const apiCharge = `{"order_id":"o-1","customer_id":"c-1","amount_cents":1999,"currency":"EUR"}`

// TestAPITokenOffLoopback runs `idemq api` on all interfaces with two tokens: /v1/ admits
// either as a bearer token and nothing else, refuses a body not declared JSON, says at
// start which rule applies, and never prints a token.
func TestAPITokenOffLoopback(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	a := startAPIProc(t, fmt.Sprintf(":%d", port), fmt.Sprintf("127.0.0.1:%d", port), testenv.RedisURL(t),
		"IDEMQ_API_TOKEN="+tokenA+", "+tokenB, "IDEMQ_DASHBOARD_USER=ops", "IDEMQ_DASHBOARD_PASSWORD=pw", "IDEMQ_LOG_LEVEL=info")
	for _, auth := range []string{"", "Bearer " + tokenA[1:], "Bearer " + tokenA + "," + tokenB, "Basic " + tokenA} {
		if code, body := a.call(t, "POST", "/v1/charges", apiCharge, "Content-Type", "application/json", "Authorization", auth); code != 401 || !strings.Contains(body, "IDEMQ_API_TOKEN") {
			t.Fatalf("POST with Authorization %q: %d %s, want 401", auth, code, body)
		}
	}
	if code, body := a.call(t, "GET", "/v1/jobs/charge:o-1", ""); code != 401 {
		t.Fatalf("GET without a token: %d %s, want 401", code, body)
	}
	if code, body := a.call(t, "POST", "/v1/charges", apiCharge, "Content-Type", "text/plain", "Authorization", "Bearer "+tokenA); code != 415 {
		t.Fatalf("POST text/plain: %d %s, want 415", code, body)
	}
	if code, body := a.call(t, "POST", "/v1/charges", apiCharge, "Content-Type", "application/json", "Authorization", "Bearer "+tokenA); code != 202 {
		t.Fatalf("POST with the first token: %d %s, want 202", code, body)
	}
	if code, body := a.call(t, "GET", "/v1/jobs/charge:o-1", "", "Authorization", "Bearer "+tokenB); code != 200 || !strings.Contains(body, `"key":"charge:o-1"`) {
		t.Fatalf("GET with the second token: %d %s", code, body)
	}
	// Guarded by a token and a password, any Host is served.
	if code, body := a.call(t, "GET", "/v1/jobs/charge:o-1", "", "Authorization", "Bearer "+tokenB, "Host", "idemq.example.com"); code != 200 {
		t.Fatalf("GET for another Host: %d %s", code, body)
	}
	log := a.stderr.String()
	if !strings.Contains(log, "/v1/ asks for a bearer token of IDEMQ_API_TOKEN") || !strings.Contains(log, "tokens=2") {
		t.Errorf("no start-up line about the API's token:\n%s", log)
	}
	if strings.Contains(log, tokenA) || strings.Contains(log, tokenB) {
		t.Errorf("the log shows a token:\n%s", log)
	}
}

// TestAPILoopbackHostAndConnections runs `idemq api` on loopback without a password or a
// token: a request for another Host (DNS rebinding) gets 421 on /v1/, /ledger/ and
// /monitoring/; a request with both Content-Length and Transfer-Encoding closes its
// connection so the request smuggled after it is never answered; and with
// IDEMQ_HTTP_MAX_CONNS connections open another one waits until one closes.
func TestAPILoopbackHostAndConnections(t *testing.T) {
	t.Parallel()
	const maxConns = 3
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	a := startAPIProc(t, addr, addr, testenv.RedisURL(t), "IDEMQ_DASHBOARD_READONLY=false",
		fmt.Sprintf("IDEMQ_HTTP_MAX_CONNS=%d", maxConns), "IDEMQ_HTTP_IDLE_TIMEOUT=1m")
	if log := a.stderr.String(); !strings.Contains(log, "IDEMQ_API_TOKEN is not set: /v1/ is open without a token to anyone on this machine") {
		t.Errorf("no start-up line about the API's loopback rule:\n%s", log)
	}
	_, port, _ := net.SplitHostPort(addr)
	for _, r := range [][3]string{{"GET", "/ledger/", ""}, {"GET", "/monitoring/api/queues", ""}, {"POST", "/monitoring/api/queues/default:pause", ""},
		{"POST", "/v1/charges", apiCharge}, {"GET", "/v1/jobs/charge:o-1", ""}} {
		if code, body := a.call(t, r[0], r[1], r[2], "Host", "rebind.evil.example:"+port, "Content-Type", "application/json"); code != 421 {
			t.Fatalf("%s %s for rebind.evil.example: %d %s, want 421", r[0], r[1], code, body)
		}
		if code, body := a.call(t, r[0], r[1], r[2], "Host", "localhost:"+port, "Content-Type", "application/json"); code >= 300 {
			t.Fatalf("%s %s for localhost: %d %s", r[0], r[1], code, body)
		}
	}

	// Request smuggling: one answer, then the connection ends.
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(30 * time.Second)) // against a hang only
	smuggled := "GET /v1/jobs/charge:o-1 HTTP/1.1\r\nHost: localhost\r\n\r\n"
	fmt.Fprintf(conn, "POST /v1/charges HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"+
		"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n%s", len(smuggled), len(apiCharge), apiCharge, smuggled)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !resp.Close {
		t.Fatalf("chunked POST: %d (close %v), want 200 (a duplicate) and the connection closed", resp.StatusCode, resp.Close)
	}
	if second, err := http.ReadResponse(br, nil); err == nil {
		t.Fatalf("the smuggled request was answered: %s", second.Status)
	}

	// The connection cap: maxConns idle keep-alives, then one more waits. The client's
	// own idle connections go first; the loop below waits until the server has let them
	// go, since each of its connections is served only then.
	http.DefaultClient.CloseIdleConnections()
	var open []net.Conn
	for range maxConns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		fmt.Fprintf(c, "GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
		c.SetReadDeadline(time.Now().Add(30 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		open = append(open, c)
	}
	extra, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	fmt.Fprintf(extra, "GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
	xr := bufio.NewReader(extra)
	extra.SetReadDeadline(time.Now().Add(time.Second))
	if _, err := xr.Peek(1); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("connection %d was served while %d were open (IDEMQ_HTTP_MAX_CONNS=%d): %v", maxConns+1, maxConns, maxConns, err)
	}
	open[0].Close()
	extra.SetReadDeadline(time.Now().Add(30 * time.Second)) // against a hang only
	if resp, err := http.ReadResponse(xr, nil); err != nil {
		t.Fatalf("connection %d not served after one closed: %v", maxConns+1, err)
	} else {
		resp.Body.Close()
	}
}

// TestAPISettingsRefusedAtStart: a malformed token, connection cap or idle timeout, and a
// dashboard password without a user, stop `idemq api` at start with a line naming the
// variable and the limit, and never the token itself.
func TestAPISettingsRefusedAtStart(t *testing.T) {
	t.Parallel()
	short := "short-token-123"
	bad := strings.Repeat("x", 31) + " " + "y"
	for _, tc := range []struct{ env, want string }{
		{"IDEMQ_API_TOKEN=" + short, "IDEMQ_API_TOKEN: the token has 15 characters; each must have 32 to 256"},
		{"IDEMQ_API_TOKEN=" + tokenA + "," + short, "IDEMQ_API_TOKEN: token 2 of 2 has 15 characters"},
		{"IDEMQ_API_TOKEN=" + tokenA + ",", "IDEMQ_API_TOKEN: token 2 of 2 is empty"},
		{"IDEMQ_API_TOKEN=" + strings.Repeat("t", 257), "IDEMQ_API_TOKEN: the token has 257 characters"},
		{"IDEMQ_API_TOKEN=" + bad, "IDEMQ_API_TOKEN: the token has a character outside A-Z a-z 0-9"},
		{"IDEMQ_HTTP_MAX_CONNS=0", "IDEMQ_HTTP_MAX_CONNS: must be"},
		{"IDEMQ_HTTP_MAX_CONNS=100001", "IDEMQ_HTTP_MAX_CONNS: must be between 1 and 100000, got 100001"},
		{"IDEMQ_HTTP_IDLE_TIMEOUT=1ms", "IDEMQ_HTTP_IDLE_TIMEOUT: must be between 1s and 1h0m0s, got 1ms"},
		{"IDEMQ_HTTP_IDLE_TIMEOUT=2h", "IDEMQ_HTTP_IDLE_TIMEOUT: must be between 1s and 1h0m0s, got 2h0m0s"},
		{"IDEMQ_DASHBOARD_PASSWORD=pw", "IDEMQ_DASHBOARD_PASSWORD is set but IDEMQ_DASHBOARD_USER is empty"},
	} {
		_, stderr, err := idemq(t, []string{tc.env, "DATABASE_URL=postgres://nobody@127.0.0.1:1/none", "REDIS_URL=redis://127.0.0.1:1/0"}, "api")
		if err == nil {
			t.Fatalf("%s: exit 0, want a failure", tc.env)
		}
		if !strings.Contains(stderr, tc.want) {
			t.Errorf("%s: stderr %q does not say %q", tc.env, stderr, tc.want)
		}
		if strings.Contains(stderr, short) || strings.Contains(stderr, tokenA) || strings.Contains(stderr, bad) {
			t.Errorf("%s: stderr shows the token: %q", tc.env, stderr)
		}
	}
	// The placeholder counts as no token, as for the dashboard's password.
	port := testenv.FreePort(t)
	a := startAPIProc(t, fmt.Sprintf(":%d", port), fmt.Sprintf("127.0.0.1:%d", port), testenv.RedisURL(t), "IDEMQ_API_TOKEN=change-me")
	if code, body := a.call(t, "GET", "/v1/jobs/charge:o-1", "", "Authorization", "Bearer change-me"); code != 403 || !strings.Contains(body, "IDEMQ_API_TOKEN") {
		t.Fatalf("GET with the placeholder token: %d %s, want 403 naming IDEMQ_API_TOKEN", code, body)
	}
}
