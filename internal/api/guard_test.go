package api

import (
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
// answer 403 naming IDEMQ_DASHBOARD_PASSWORD; the API, /metrics and the health endpoints
// keep working. On loopback they are open; with a password they ask for it.
func TestDashboardNeedsPasswordOffLoopback(t *testing.T) {
	t.Parallel()
	guarded := []string{"/monitoring/", "/monitoring/api/queues", "/monitoring/static/js/main.5adda2da.chunk.js", "/ledger/", "/ledger/charge:o-1"}
	for _, o := range []Options{
		{ListenAddr: ":8080"},
		{ListenAddr: "0.0.0.0:8080", DashboardUser: "idemq", DashboardPassword: PlaceholderPassword},
	} {
		a := newTestAPI(t, &o)
		if got := a.s.Dashboard(); got != AccessRefused {
			t.Fatalf("%+v: Dashboard() = %v, want AccessRefused", o, got)
		}
		a.publish(t, "o-1")
		for _, path := range guarded {
			a.do(t, "GET", path, "").wantError(t, 403, "set IDEMQ_DASHBOARD_PASSWORD")
			a.do(t, "GET", path, "", "Authorization", basic("idemq", PlaceholderPassword)).wantError(t, 403, "IDEMQ_DASHBOARD_PASSWORD")
		}
		a.do(t, "POST", "/monitoring/api/queues/default:pause", "").wantError(t, 403, "IDEMQ_DASHBOARD_PASSWORD")
		a.do(t, "POST", "/v1/charges", chargeBody("o-2", 100)).want(t, 202)
		a.do(t, "GET", "/v1/jobs/charge:o-1", "").want(t, 200, `"key":"charge:o-1"`)
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
