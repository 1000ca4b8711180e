package api

import (
	"strings"
	"testing"
)

func TestLoopback(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:8080": true, "127.1.2.3:8080": true, "[::1]:8080": true, "localhost:8080": true, "LOCALHOST:0": true,
		":8080": false, "0.0.0.0:8080": false, "[::]:8080": false, "192.168.1.5:8080": false, "example.com:8080": false,
		"": false, "127.0.0.1": false, "[::ffff:127.0.0.1]:8080": true,
	} {
		if got := loopback(addr); got != want {
			t.Errorf("loopback(%q) = %v, want %v", addr, got, want)
		}
	}
}

// TestDashboardNeedsPasswordOffLoopback: with no password (or the placeholder compose.yaml
// ships) and a listen address that is not loopback, the dashboard and the ledger page
// answer 403 naming IDEMQ_DASHBOARD_USER and IDEMQ_DASHBOARD_PASSWORD; the API (with its
// token), /metrics and the health endpoints keep working. On loopback they are open; with
// a password they ask for it.
func TestDashboardNeedsPasswordOffLoopback(t *testing.T) {
	t.Parallel()
	guarded := []string{"/monitoring/", "/monitoring/api/queues", "/monitoring/static/js/main.5adda2da.chunk.js", "/ledger/", "/ledger/charge:o-1"}
	for _, o := range []Options{
		{ListenAddr: ":8080", APITokens: []string{testToken}},
		{ListenAddr: "0.0.0.0:8080", DashboardUser: "idemq", DashboardPassword: PlaceholderPassword, APITokens: []string{testToken}},
	} {
		a := newTestAPI(t, &o)
		if got := a.s.Dashboard(); got != AccessRefused {
			t.Fatalf("%+v: Dashboard() = %v, want AccessRefused", o, got)
		}
		a.publish(t, "o-1")
		for _, path := range guarded {
			// Both variables, since a password without a user stops idemq api at start.
			a.do(t, "GET", path, "").wantError(t, 403, "set IDEMQ_DASHBOARD_USER and IDEMQ_DASHBOARD_PASSWORD")
			a.do(t, "GET", path, "", "Authorization", basic("idemq", PlaceholderPassword)).wantError(t, 403, "IDEMQ_DASHBOARD_PASSWORD")
		}
		a.do(t, "POST", "/monitoring/api/queues/default:pause", "").wantError(t, 403, "IDEMQ_DASHBOARD_PASSWORD")
		a.do(t, "POST", "/v1/charges", chargeBody("o-2", 100), "Authorization", "Bearer "+testToken).want(t, 202)
		a.do(t, "GET", "/v1/jobs/charge:o-1", "", "Authorization", "Bearer "+testToken).want(t, 200, `"key":"charge:o-1"`)
		for _, path := range []string{"/metrics", "/healthz", "/readyz"} {
			a.do(t, "GET", path, "").want(t, 200)
		}
	}

	a := newTestAPI(t, &Options{ListenAddr: "[::1]:8080"})
	if got := a.s.Dashboard(); got != AccessLoopback {
		t.Fatalf("Dashboard() = %v, want AccessLoopback", got)
	}
	a.do(t, "GET", "/ledger/", "").want(t, 200, `id="rows"`)
	a.do(t, "GET", "/monitoring/", "").want(t, 200, `<div id="root">`)

	a = newTestAPI(t, &Options{ListenAddr: ":8080", DashboardUser: "ops", DashboardPassword: "s3cret"})
	if got := a.s.Dashboard(); got != AccessPassword {
		t.Fatalf("Dashboard() = %v, want AccessPassword", got)
	}
	a.do(t, "GET", "/ledger/", "").wantError(t, 401, "authentication required")
	a.do(t, "GET", "/ledger/", "", "Authorization", basic("ops", "s3cret")).want(t, 200, `id="rows"`)
}

// TestDashboardRefusesCrossOriginWrites: a write to the dashboard from another origin (a
// form on another site, sent with the operator's credentials) is refused before it
// reaches asynqmon, by Sec-Fetch-Site or, without it, by Origin; the same origin and
// clients that send neither (curl) go through.
func TestDashboardRefusesCrossOriginWrites(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, &Options{DashboardActions: true, DashboardUser: "ops", DashboardPassword: "s3cret"})
	a.publish(t, "o-1")
	good := basic("ops", "s3cret")
	host := strings.TrimPrefix(a.URL, "http://")
	pause := "/monitoring/api/queues/default:pause"
	for _, h := range [][]string{
		{"Sec-Fetch-Site", "cross-site"},
		{"Sec-Fetch-Site", "same-site"},
		{"Sec-Fetch-Site", "cross-site", "Origin", a.URL},
		{"Origin", "http://evil.example"},
		{"Origin", "http://" + host + ".evil.example"},
		{"Origin", "null"},
	} {
		a.do(t, "POST", pause, "", append([]string{"Authorization", good}, h...)...).wantError(t, 403, "cross-origin request refused")
		a.do(t, "DELETE", "/monitoring/api/queues/default/pending_tasks/charge:o-1", "", append([]string{"Authorization", good}, h...)...).
			wantError(t, 403, "cross-origin request refused")
		// Reads are not writes: asynqmon still answers them.
		a.do(t, "GET", "/monitoring/api/queues/default", "", append([]string{"Authorization", good}, h...)...).want(t, 200, `"paused":false`, `"pending":1`)
	}
	a.do(t, "POST", pause, "", "Authorization", good, "Sec-Fetch-Site", "same-origin", "Origin", a.URL).want(t, 204)
	a.do(t, "POST", "/monitoring/api/queues/default:resume", "", "Authorization", good, "Origin", a.URL).want(t, 204)
	a.do(t, "POST", pause, "", "Authorization", good).want(t, 204) // no browser headers: curl
	a.do(t, "GET", "/monitoring/api/queues/default", "", "Authorization", good).want(t, 200, `"paused":true`, `"pending":1`)
}

// TestPagesSendSecurityHeaders: every answer of the dashboard and of the ledger page
// forbids framing and carries its Content-Security-Policy (the browser test checks that
// the pages run under it); asynqmon's index page comes without its Google Fonts links.
func TestPagesSendSecurityHeaders(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	a.publish(t, "o-1")
	for _, path := range []string{"/monitoring/", "/monitoring/queues/default/tasks/charge:o-1", "/monitoring/api/queues",
		"/monitoring/static/js/main.5adda2da.chunk.js", "/ledger/", "/ledger/charge:o-1", "/ledger/charge:nope", "/ledger/%00"} {
		ans := a.do(t, "GET", path, "")
		if ans.code != 200 && ans.code != 404 {
			t.Fatalf("%s: %d %s", path, ans.code, ans.body)
		}
		if got := ans.header.Get("X-Frame-Options"); got != "DENY" {
			t.Errorf("%s: X-Frame-Options %q, want DENY", path, got)
		}
		csp := ans.header.Get("Content-Security-Policy")
		for _, want := range []string{"default-src 'none'", "frame-ancestors 'none'", "base-uri 'none'"} {
			if !strings.Contains(csp, want) {
				t.Errorf("%s: Content-Security-Policy %q lacks %q", path, csp, want)
			}
		}
		if strings.Contains(csp, "unsafe-eval") || strings.Contains(csp, "script-src 'unsafe-inline'") || strings.Contains(csp, "*") {
			t.Errorf("%s: Content-Security-Policy %q is not restrictive", path, csp)
		}
		if strings.HasPrefix(path, "/ledger/") && (strings.Contains(csp, "script-src") || strings.Contains(csp, "unsafe-inline")) {
			t.Errorf("%s: the ledger page runs no script and pins its style: %q", path, csp)
		}
	}
	index := a.do(t, "GET", "/monitoring/queues/default", "").want(t, 200, `<div id="root">`, `window.FLAG_ROOT_PATH=`)
	if ct := index.header.Get("Content-Type"); ct != "text/html; charset=utf-8" {
		t.Errorf("asynqmon's index page: Content-Type %q", ct)
	}
	if strings.Contains(index.body, "fonts.googleapis.com") {
		t.Errorf("asynqmon's index page still links Google Fonts:\n%s", index.body)
	}
	// A 401 carries them too.
	b := newTestAPI(t, &Options{DashboardPassword: "pw"})
	if got := b.do(t, "GET", "/monitoring/", "").header.Get("X-Frame-Options"); got != "DENY" {
		t.Errorf("401: X-Frame-Options %q, want DENY", got)
	}
}
