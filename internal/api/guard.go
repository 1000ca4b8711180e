package api

import (
	"crypto/sha256"
	"crypto/subtle"
	"net"
	"net/http"
	"net/netip"
	"strings"
)

// PlaceholderPassword is the IDEMQ_DASHBOARD_PASSWORD that compose.yaml falls back on. It
// counts as no password, and as an API token it counts as no token.
const PlaceholderPassword = "change-me"

// Access is how a group of routes is guarded: the dashboard (/monitoring/) and the ledger
// page (/ledger/, /schedule/), which show every payload and result, or the API (/v1/),
// which accepts jobs and hands out their results.
type Access int

const (
	// AccessPassword: the dashboard and the ledger page ask for basic auth
	// (Options.DashboardPassword is set).
	AccessPassword Access = iota
	// AccessLoopback: no password (or token), and the server listens on a loopback address
	// only (Options.ListenAddr): the routes are open to anyone on this machine, for
	// requests whose Host is localhost or a loopback address (else 421, which stops DNS
	// rebinding).
	AccessLoopback
	// AccessRefused: no password (or token), and a listen address that is not loopback:
	// the routes answer 403 naming IDEMQ_DASHBOARD_USER and IDEMQ_DASHBOARD_PASSWORD (or
	// IDEMQ_API_TOKEN).
	// /metrics and the health endpoints are served all the same.
	AccessRefused
	// AccessToken: the API asks for a bearer token (Options.APITokens is set).
	AccessToken
)

// Dashboard reports how the dashboard and the ledger page are guarded: AccessPassword,
// AccessLoopback or AccessRefused.
func (s *Server) Dashboard() Access {
	switch {
	case s.opts.DashboardPassword != "":
		return AccessPassword
	case loopback(s.opts.ListenAddr):
		return AccessLoopback
	}
	return AccessRefused
}

// API reports how the API's routes (/v1/) are guarded: AccessToken, AccessLoopback or
// AccessRefused.
func (s *Server) API() Access {
	switch {
	case len(s.opts.APITokens) > 0:
		return AccessToken
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

// loopbackHost reports whether host, a request's Host header, names this machine:
// localhost, localhost. or a loopback IPv4 or IPv6 literal, with or without a port. A
// page of another site that a rebinding DNS name points at 127.0.0.1 sends its own name.
func loopbackHost(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	} else if strings.HasPrefix(host, "[") && strings.HasSuffix(host, "]") {
		host = host[1 : len(host)-1]
	}
	if strings.EqualFold(host, "localhost") || strings.EqualFold(host, "localhost.") {
		return true
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.IsLoopback()
}

// onlyLoopbackHost answers 421 to a request whose Host does not name this machine (see
// loopbackHost).
func onlyLoopbackHost(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !loopbackHost(r.Host) {
			writeError(w, http.StatusMisdirectedRequest, "misdirected request: without a password or token this server answers only "+
				"requests for localhost or a loopback address (set IDEMQ_DASHBOARD_PASSWORD and IDEMQ_API_TOKEN to serve other host names)")
			return
		}
		h.ServeHTTP(w, r)
	})
}

// page guards a handler of the dashboard or of the ledger page: every answer carries
// csp, X-Frame-Options: DENY and Cache-Control: no-store; a cross-origin request that is
// not a GET or HEAD is refused (403, by http.CrossOriginProtection: Sec-Fetch-Site other
// than same-origin or none, else an Origin whose host is not the request's); then basic
// auth, or without a password 403 unless the server listens on loopback, and then 421
// unless the request's Host names this machine.
func (s *Server) page(csp string, h http.Handler) http.Handler {
	switch s.Dashboard() {
	case AccessPassword:
		h = s.auth(h)
	case AccessRefused:
		h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			writeError(w, http.StatusForbidden, "the dashboard and the ledger page need a user and a password: set IDEMQ_DASHBOARD_USER and IDEMQ_DASHBOARD_PASSWORD "+
				"(without them they are served only when IDEMQ_HTTP_ADDR is a loopback address such as 127.0.0.1:8080)")
		})
	case AccessLoopback:
		h = onlyLoopbackHost(h)
	}
	h = s.crossOrigin.Handler(h)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Security-Policy", csp)
		w.Header().Set("X-Frame-Options", "DENY")
		w.Header().Set("Cache-Control", "no-store")
		h.ServeHTTP(w, r)
	})
}

// apiGuard guards the API's handlers: every answer carries Cache-Control: no-store; a
// cross-origin request that is not a GET or HEAD is refused (403); then a bearer token of
// Options.APITokens, or without tokens 403 naming IDEMQ_API_TOKEN unless the server
// listens on loopback, and then 421 unless the request's Host names this machine.
func (s *Server) apiGuard() func(http.Handler) http.Handler {
	access := s.API()
	var want [][sha256.Size]byte
	for _, t := range s.opts.APITokens {
		want = append(want, sha256.Sum256([]byte(t)))
	}
	return func(h http.Handler) http.Handler {
		switch access {
		case AccessToken:
			h = bearer(want, h)
		case AccessRefused:
			h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				writeError(w, http.StatusForbidden, "the API needs a token: set IDEMQ_API_TOKEN "+
					"(without one /v1/ is served only when IDEMQ_HTTP_ADDR is a loopback address such as 127.0.0.1:8080)")
			})
		case AccessLoopback:
			h = onlyLoopbackHost(h)
		}
		h = s.crossOrigin.Handler(h)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Cache-Control", "no-store")
			h.ServeHTTP(w, r)
		})
	}
}

// bearer admits a request whose Authorization is "Bearer <token>" with a token whose
// SHA-256 is one of want. Every token is compared, in constant time over the hashes, so
// neither which token matched nor any length leaks.
func bearer(want [][sha256.Size]byte, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		scheme, token, ok := strings.Cut(r.Header.Get("Authorization"), " ")
		got := sha256.Sum256([]byte(token))
		match := 0
		for i := range want {
			match |= subtle.ConstantTimeCompare(got[:], want[i][:])
		}
		if !ok || !strings.EqualFold(scheme, "Bearer") || match != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="idemq api"`)
			writeError(w, http.StatusUnauthorized, "authentication required: send Authorization: Bearer followed by a token of IDEMQ_API_TOKEN")
			return
		}
		h.ServeHTTP(w, r)
	})
}

// newCrossOrigin is the check of page and apiGuard, answering in the API's JSON error
// form.
func newCrossOrigin() *http.CrossOriginProtection {
	c := http.NewCrossOriginProtection()
	c.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusForbidden, "cross-origin request refused: only pages of this server may send "+r.Method+" here")
	}))
	return c
}
