package api

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/hibiken/asynqmon"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/groupcommit"
	"github.com/idemq/idemq/internal/metrics"
)

// DefaultMaxBodyBytes is the largest request body the API reads; a larger one is refused
// with 413 before it is parsed.
const DefaultMaxBodyBytes = 64 << 10

// Deps are the API's required dependencies.
type Deps struct {
	// Pool holds the ledger, the outbox and api_idempotency_keys.
	Pool *pgxpool.Pool
	// Redis answers /readyz and feeds the ledger page's task links.
	Redis redis.UniversalClient
	// Ledger answers GET /v1/jobs/{key} and the ledger page.
	Ledger *idempotency.Ledger
	// Enqueuer records a job's intent inside the API's transaction (an
	// *outbox.Client).
	Enqueuer Enqueuer
	// Metrics gets the API's request counters; its registry is served at /metrics.
	Metrics *metrics.Metrics
}

// Options are the API's optional settings; the zero value (or nil) means the defaults
// written on each field.
type Options struct {
	// RedisConnOpt is the Redis that asynqmon, the dashboard, inspects. Nil: no dashboard
	// at /monitoring/ (404).
	RedisConnOpt asynq.RedisConnOpt
	// DashboardUser and DashboardPassword protect /monitoring/, /ledger/ and /schedule/
	// with basic auth when DashboardPassword is not empty (PlaceholderPassword counts as
	// empty). Default: no password, and then they answer 403 unless ListenAddr is
	// loopback.
	DashboardUser     string
	DashboardPassword string
	// APITokens are the bearer tokens /v1/ admits (IDEMQ_API_TOKEN, split at its
	// commas): a request sends one as "Authorization: Bearer <token>". Several tokens let
	// clients move to a new one before the old one is dropped. Empty entries and
	// PlaceholderPassword are ignored. Default none: /v1/ answers 403 unless ListenAddr is
	// loopback.
	APITokens []string
	// ListenAddr is the address the server listens on (IDEMQ_HTTP_ADDR). Without a
	// DashboardPassword, /monitoring/, /ledger/ and /schedule/ are served only when it is a loopback
	// address (127.0.0.1:8080, [::1]:8080, localhost:8080), and then only to requests whose
	// Host is localhost or a loopback address (421 otherwise); without APITokens, so is
	// /v1/. Default "": not loopback.
	ListenAddr string
	// DashboardActions allows the dashboard's actions (run, delete, archive, pause).
	// Default false: read-only, because "run" on an archived duplicate whose ledger key
	// was purged would run its effect again.
	DashboardActions bool
	// MaxBodyBytes caps request bodies. Default DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// RequestTimeout bounds each request (its context's deadline; the enqueue
	// transaction's statement_timeout sits just below it): past it the client gets 503
	// with Retry-After. Keep the HTTP server's write timeout above it. Default
	// DefaultRequestTimeout (10s).
	RequestTimeout time.Duration
	// Logger gets request errors. Default: discard.
	Logger *slog.Logger
	// TraceURLTemplate is a trace's page in the tracing UI, with {trace_id} where its id
	// goes (IDEMQ_TRACE_URL_TEMPLATE): the ledger page links a key accepted in a traced
	// request to that trace. Default: no link.
	TraceURLTemplate string
	// TracerProvider makes the span of each accept transaction two or more traced
	// requests share (idemq.accept); nil: the global one (otel.GetTracerProvider).
	TracerProvider trace.TracerProvider
}

// Server is the API's http.Handler. It is safe for concurrent use; Close releases the
// dashboard's Redis connections.
type Server struct {
	deps    Deps
	opts    Options
	mux     *http.ServeMux
	monitor *asynqmon.HTTPHandler
	insp    *asynq.Inspector
	log     *slog.Logger
	// crossOrigin refuses cross-origin writes to the dashboard and the ledger page.
	crossOrigin *http.CrossOriginProtection

	// accepts shares transactions among concurrent POSTs (sendAccepts).
	accepts *groupcommit.Committer[*acceptReq]
	tracer  trace.Tracer

	// holdAccept, when set by a test, runs inside a round's transaction after its rows
	// are written and before the commit, with the context of the round's first request.
	holdAccept func(ctx context.Context)
}

var _ http.Handler = (*Server)(nil)

// New returns the API's handler. It panics on missing Deps, as a wiring mistake.
func New(deps Deps, opts *Options) *Server {
	if deps.Pool == nil || deps.Redis == nil || deps.Ledger == nil || deps.Enqueuer == nil || deps.Metrics == nil {
		panic("api.New: Deps.Pool, Redis, Ledger, Enqueuer and Metrics are required")
	}
	s := &Server{deps: deps, mux: http.NewServeMux()}
	if opts != nil {
		s.opts = *opts
	}
	if s.opts.MaxBodyBytes <= 0 {
		s.opts.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if s.opts.RequestTimeout <= 0 {
		s.opts.RequestTimeout = DefaultRequestTimeout
	}
	s.log = s.opts.Logger
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	s.insp = asynq.NewInspectorFromRedisClient(deps.Redis)
	if s.opts.DashboardPassword == PlaceholderPassword {
		s.opts.DashboardPassword = ""
	}
	s.opts.APITokens = slices.DeleteFunc(slices.Clone(s.opts.APITokens), func(t string) bool {
		return t == "" || t == PlaceholderPassword
	})
	s.crossOrigin = newCrossOrigin()
	tp := s.opts.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	s.tracer = tp.Tracer("github.com/idemq/idemq/internal/api")
	s.accepts = s.newAcceptCommitter()

	v1 := s.apiGuard()
	s.mux.Handle("POST /v1/charges", v1(http.HandlerFunc(s.postCharge)))
	s.mux.Handle("POST /v1/wallet/debits", v1(http.HandlerFunc(s.postDebit)))
	s.mux.Handle("POST /v1/checkouts", v1(http.HandlerFunc(s.postCheckout)))
	s.mux.Handle("GET /v1/jobs/{key...}", v1(http.HandlerFunc(s.getJob)))
	s.mux.Handle("GET /v1/schedule", v1(http.HandlerFunc(s.getSchedule)))
	s.mux.Handle("/v1/charges", v1(allow("POST")))
	s.mux.Handle("/v1/wallet/debits", v1(allow("POST")))
	s.mux.Handle("/v1/checkouts", v1(allow("POST")))
	s.mux.Handle("/v1/jobs/{key...}", v1(allow("GET, HEAD")))
	s.mux.Handle("/v1/schedule", v1(allow("GET, HEAD")))
	s.mux.Handle("/v1/", v1(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "no route "+r.Method+" "+r.URL.Path)
	})))

	s.mux.Handle("GET /ledger/{$}", s.page(ledgerCSP, http.HandlerFunc(s.ledgerList)))
	s.mux.Handle("GET /ledger/{key...}", s.page(ledgerCSP, http.HandlerFunc(s.ledgerRow)))
	s.mux.Handle("GET /ledger", http.RedirectHandler("/ledger/", http.StatusMovedPermanently))
	// The schedule has a root of its own: any /ledger/ path but the list is a key's page.
	s.mux.Handle("GET /schedule/{$}", s.page(ledgerCSP, http.HandlerFunc(s.schedulePage)))
	s.mux.Handle("GET /schedule", http.RedirectHandler("/schedule/", http.StatusMovedPermanently))

	if s.opts.RedisConnOpt != nil {
		s.monitor = asynqmon.New(asynqmon.Options{
			RootPath:        "/monitoring",
			RedisConnOpt:    s.opts.RedisConnOpt,
			ReadOnly:        !s.opts.DashboardActions,
			ResultFormatter: asynqmon.ResultFormatterFunc(prettyResult),
		})
		index, csp, err := monitorIndex(s.monitor, "/monitoring")
		if err != nil {
			s.log.Error("api: the dashboard's page cannot run under its CSP", "err", err)
			csp = monitorCSP(nil)
		}
		s.mux.Handle("/monitoring/", s.page(csp, withIndex(s.monitor, index)))
		if path, js, err := wholeTaskIDs(s.monitor, index); err != nil {
			s.log.Error("api: the dashboard will cut task IDs at their first '-'", "err", err)
		} else {
			s.mux.Handle("GET "+path, s.page(csp, serveScript(js)))
		}
		s.mux.Handle("GET /monitoring", http.RedirectHandler("/monitoring/", http.StatusMovedPermanently))
	}

	health := deps.Metrics.Handler(map[string]metrics.Check{
		"redis":    func(ctx context.Context) error { return deps.Redis.Ping(ctx).Err() },
		"postgres": func(ctx context.Context) error { return deps.Pool.Ping(ctx) },
	}, s.log)
	s.mux.Handle("GET /metrics", health)
	s.mux.Handle("GET /healthz", health)
	s.mux.Handle("GET /readyz", health)
	s.mux.Handle("GET /{$}", http.RedirectHandler("/ledger/", http.StatusFound))
	return s
}

// allow answers 405 naming the methods a route takes in Allow.
func allow(methods string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Allow", methods)
		writeError(w, http.StatusMethodNotAllowed, "method "+r.Method+" not allowed on "+r.URL.Path+"; allowed: "+methods)
	})
}

// Close releases the dashboard's Redis connections.
func (s *Server) Close() error {
	if s.monitor != nil {
		return s.monitor.Close()
	}
	return nil // s.insp shares Deps.Redis, which the caller closes
}

// ServeHTTP runs each request under Options.RequestTimeout and counts it by route
// pattern and status code. A handler that ends without answering never leaves an implicit
// 200 (which means "duplicate" here): its client gets 503 if the deadline passed, 500
// otherwise, and a client that already went away is counted and logged as 499.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeoutCause(r.Context(), s.opts.RequestTimeout, errRequestTimeout)
	defer cancel()
	r = r.WithContext(ctx)
	rec := &statusRecorder{ResponseWriter: w}
	s.mux.ServeHTTP(rec, r)
	route := r.Pattern
	if route == "" {
		route = "unmatched"
	}
	if span := trace.SpanFromContext(ctx); span.IsRecording() { // the server span (tracing on)
		path := strings.TrimPrefix(route, r.Method+" ")
		span.SetName(r.Method + " " + path)
		span.SetAttributes(attribute.String("http.route", path))
	}
	if rec.code == 0 {
		switch {
		case clientGone(ctx):
			rec.code = StatusClientClosedRequest
			s.log.InfoContext(ctx, "api: client went away before the answer", "method", r.Method, "path", r.URL.Path, "status", rec.code)
		case timedOut(ctx):
			unavailable(rec, "timed out; retry later")
		default:
			s.log.ErrorContext(ctx, "api: handler ended without an answer", "method", r.Method, "path", r.URL.Path)
			writeError(rec, http.StatusInternalServerError, "internal error")
		}
	}
	s.deps.Metrics.APIRequests.WithLabelValues(route, strconv.Itoa(rec.code)).Inc()
}

// statusRecorder remembers the status a handler answered; code is 0 until it answers.
// A 413 closes the connection: http.MaxBytesReader, given the recorder rather than the
// server's own writer, cannot tell the server to, and the rest of an oversized body must
// not be read as the next request.
type statusRecorder struct {
	http.ResponseWriter
	code int
}

func (r *statusRecorder) WriteHeader(code int) {
	if r.code == 0 && code >= 200 {
		r.code = code
		if code == http.StatusRequestEntityTooLarge {
			r.Header().Set("Connection", "close")
		}
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *statusRecorder) Write(b []byte) (int, error) {
	if r.code == 0 {
		r.code = http.StatusOK
	}
	return r.ResponseWriter.Write(b)
}

// Flush flushes the underlying writer, which sends an implicit 200 when nothing was
// written yet.
func (r *statusRecorder) Flush() {
	if r.code == 0 {
		r.code = http.StatusOK
	}
	http.NewResponseController(r.ResponseWriter).Flush()
}

// Unwrap lets http.ResponseController reach the underlying writer (asynqmon flushes).
func (r *statusRecorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

// auth asks for basic auth when a dashboard password is configured. Both the user and the
// password are compared in constant time (over their SHA-256, so lengths do not leak).
func (s *Server) auth(h http.Handler) http.Handler {
	if s.opts.DashboardPassword == "" {
		return h
	}
	wantUser := sha256.Sum256([]byte(s.opts.DashboardUser))
	wantPass := sha256.Sum256([]byte(s.opts.DashboardPassword))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, pass, ok := r.BasicAuth()
		gotUser, gotPass := sha256.Sum256([]byte(user)), sha256.Sum256([]byte(pass))
		userOK := subtle.ConstantTimeCompare(gotUser[:], wantUser[:])
		passOK := subtle.ConstantTimeCompare(gotPass[:], wantPass[:])
		if !ok || userOK&passOK != 1 {
			w.Header().Set("WWW-Authenticate", `Basic realm="idemq dashboard", charset="UTF-8"`)
			writeError(w, http.StatusUnauthorized, "authentication required")
			return
		}
		h.ServeHTTP(w, r)
	})
}
