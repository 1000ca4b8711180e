package api

import (
	"net"
	"net/http"
	"net/netip"
	"strings"
)

// PlaceholderPassword is the IDEMQ_DASHBOARD_PASSWORD that compose.yaml falls back on. It
// counts as no password.
const PlaceholderPassword = "change-me"

// DashboardAccess is how the dashboard (/monitoring/) and the ledger page (/ledger/),
// which show every payload and result, are guarded.
type DashboardAccess int

const (
	// AccessPassword: they ask for basic auth (Options.DashboardPassword is set).
	AccessPassword DashboardAccess = iota
	// AccessLoopback: no password, and the server listens on a loopback address only
	// (Options.ListenAddr): they are open to anyone on this machine.
	AccessLoopback
	// AccessRefused: no password, and a listen address that is not loopback: they answer
	// 403 naming IDEMQ_DASHBOARD_PASSWORD. The API, /metrics and the health endpoints
	// are served all the same.
	AccessRefused
)

// Dashboard reports how the dashboard and the ledger page are guarded.
func (s *Server) Dashboard() DashboardAccess {
	switch {
	case s.opts.DashboardPassword != "":
		return AccessPassword
	case loopback(s.opts.ListenAddr):
		return AccessLoopback
	}
	return AccessRefused
}

// loopback reports whether addr, a host:port to listen on, is on loopback only:
// 127.0.0.1:8080, [::1]:8080 and localhost:8080 are; :8080, 0.0.0.0:8080, [::]:8080 and
// any other host are not.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.IsLoopback()
}

// page guards a handler of the dashboard or of the ledger page: every answer carries
// csp and X-Frame-Options: DENY; a cross-origin request that is not a GET or HEAD is
// refused (403, by http.CrossOriginProtection: Sec-Fetch-Site other than same-origin or
// none, else an Origin whose host is not the request's); then basic auth, or without a
// password 403 unless the server listens on loopback.
func (s *Server) page(csp string, h http.Handler) http.Handler {
	switch s.Dashboard() {
	case AccessPassword:
		h = s.auth(h)
	case AccessRefused:
		h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			writeError(w, http.StatusForbidden, "the dashboard and the ledger page need a password: set IDEMQ_DASHBOARD_PASSWORD "+
				"(without one they are served only when IDEMQ_HTTP_ADDR is a loopback address such as 127.0.0.1:8080)")
		})
	}
	h = s.crossOrigin.Handler(h)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Security-Policy", csp)
		w.Header().Set("X-Frame-Options", "DENY")
		h.ServeHTTP(w, r)
	})
}

// newCrossOrigin is the check of page, answering in the API's JSON error form.
func newCrossOrigin() *http.CrossOriginProtection {
	c := http.NewCrossOriginProtection()
	c.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusForbidden, "cross-origin request refused: only pages of this server may send "+r.Method+" here")
	}))
	return c
}
