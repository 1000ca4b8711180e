// Package fakepay is a stand-in payment provider for idemq's example domain and tests.
//
// It records every request in fakepay_requests (with the time it arrived and the fence of
// its Idemq-Fence header, when it has one) and every charge it creates in
// fakepay_charges. Like Stripe, it honours the Idempotency-Key header (when HonorKeys is
// set): a repeated key returns the first charge, a key reused with other parameters is
// refused with 400, and a request whose key is still being processed gets 409. With
// HonorKeys off it creates a charge per request, to show what the ledger alone prevents.
//
// POST /v1/emails stands for a provider without idempotency: it stores every request in
// fakepay_emails (with its key, from the Idemq-Key header or an older caller's
// Idempotency-Key, and its Idemq-Fence header, never honoured) and answers 202, so an
// email sent twice is two rows.
//
// A key follows the ledger's rules (idempotency.ValidateKey), or is a step's key
// (<job key>#s/<name>); a request with a bad key gets 400. Errors are JSON {"error": "..."}; an internal failure answers "internal error" with
// 500 and logs its cause, so a caller never sees a database error.
package fakepay

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/tasks"
)

// ChargeRequest is the body of POST /v1/charges.
type ChargeRequest struct {
	OrderID     string `json:"order_id"`
	CustomerID  string `json:"customer_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
}

// Charge is a created charge, the body of a successful answer.
type Charge struct {
	ID             string    `json:"id"`
	IdempotencyKey string    `json:"idempotency_key,omitempty"`
	OrderID        string    `json:"order_id"`
	CustomerID     string    `json:"customer_id"`
	AmountCents    int64     `json:"amount_cents"`
	Currency       string    `json:"currency"`
	CreatedAt      time.Time `json:"created_at"`
	// Replayed is true when the answer repeats an earlier request's charge.
	Replayed bool `json:"replayed"`
}

// Config configures the provider.
type Config struct {
	// HonorKeys makes a repeated Idempotency-Key return the first charge.
	HonorKeys bool
	// Delay is the upper bound of a random delay added to each charge request (0: none).
	Delay time.Duration
	// Logger receives one line per request; nil discards.
	Logger *slog.Logger
}

// Server is the provider's HTTP handler. It is safe for concurrent use.
type Server struct {
	pool *pgxpool.Pool
	cfg  Config
	mux  *http.ServeMux
}

// New returns the provider on pool, whose schema must be migrated.
func New(pool *pgxpool.Pool, cfg Config) *Server {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Server{pool: pool, cfg: cfg, mux: http.NewServeMux()}
	s.mux.HandleFunc("POST /v1/charges", s.createCharge)
	s.mux.HandleFunc("POST /v1/emails", s.sendEmail)
	s.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("ok\n")) })
	return s
}

// ServeHTTP serves POST /v1/charges and GET /healthz.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

// errInFlight answers a request whose key another request is still processing.
var errInFlight = errors.New("a request with this Idempotency-Key is in progress; retry later")

// errKeyReused answers a key seen before with other parameters.
var errKeyReused = errors.New("Idempotency-Key was used before with different parameters")

// errInternal answers a failure that is not the caller's; the cause is only logged.
var errInternal = errors.New("internal error")

// headerFence is the request header carrying the caller's fence (idemq's claim), recorded
// with the request.
const headerFence = "Idemq-Fence"

// fence returns the request's Idemq-Fence header, 0 without one.
func fence(h http.Header) (int64, error) {
	vs := h.Values(headerFence)
	switch {
	case len(vs) == 0:
		return 0, nil
	case len(vs) > 1:
		return 0, fmt.Errorf("%s header: given %d times, must be given once", headerFence, len(vs))
	}
	n, err := strconv.ParseInt(vs[0], 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%s header: %.32q is not a fence (a non-negative integer)", headerFence, vs[0])
	}
	return n, nil
}

// headerKey is the request header in which a caller of the email endpoint, which honours
// no key, sends its key for the record: an Idempotency-Key there would let Go's transport
// send the request twice on its own (it treats a POST with that header as replayable).
const headerKey = "Idemq-Key"

// idempotencyKey returns the request's Idempotency-Key header, "" without one. A key is
// stored and compared as text, so it must be given once and follow the ledger's key rules.
func idempotencyKey(h http.Header) (string, error) { return keyHeader(h, "Idempotency-Key") }

// keyHeader returns the request's header name, checked as idempotencyKey checks it.
func keyHeader(h http.Header, name string) (string, error) {
	keys := h.Values(name)
	switch {
	case len(keys) == 0:
		return "", nil
	case len(keys) > 1:
		return "", fmt.Errorf("%s header: given %d times, must be given once", name, len(keys))
	}
	if err := checkKey(keys[0]); err != nil {
		return "", fmt.Errorf("%s header: %w", name, err)
	}
	return keys[0], nil
}

// recordedKey returns the key an email request carries for the record: its Idemq-Key
// header, or the Idempotency-Key an older caller sends; both given must agree.
func recordedKey(h http.Header) (string, error) {
	key, err := keyHeader(h, headerKey)
	if err != nil {
		return "", err
	}
	old, err := idempotencyKey(h)
	switch {
	case err != nil:
		return "", err
	case key == "":
		return old, nil
	case old != "" && old != key:
		return "", fmt.Errorf("%s and Idempotency-Key headers differ: send one key", headerKey)
	}
	return key, nil
}

// checkKey accepts a job key (idempotency.ValidateKey) or a step's key, the job's key with
// "#s/<name>" after it (idempotency.StepKey): what idemq hands a provider.
func checkKey(key string) error {
	job, name, isStep := strings.Cut(key, idempotency.StepKeySeparator)
	if err := idempotency.ValidateKey(job); err != nil || !isStep {
		return err
	}
	_, err := idempotency.StepKey(job, name)
	return err
}

func (s *Server) createCharge(w http.ResponseWriter, r *http.Request) {
	// Like a real provider, finish what was asked even if the caller hangs up: the charge
	// exists whether or not the caller hears about it (the crash window idemq guards).
	ctx := context.WithoutCancel(r.Context())
	rec := record{received: time.Now()}
	key, keyErr := idempotencyKey(r.Header)
	rec.fence, rec.fenceErr = fence(r.Header)
	var req ChargeRequest
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 64<<10))
	dec.DisallowUnknownFields()
	err := dec.Decode(&req)
	if err == nil {
		err = tasks.Charge(req).Validate()
	}
	if rec.fenceErr != nil {
		err = rec.fenceErr
	}
	if keyErr != nil { // the headers are reported first; the body is still recorded
		err = keyErr
	}
	if err != nil {
		s.answer(ctx, w, rec, key, req, nil, http.StatusBadRequest, err)
		return
	}
	var ch *Charge
	if s.cfg.HonorKeys && key != "" {
		ch, err = s.chargeOnce(ctx, key, req)
	} else if err = s.work(ctx); err == nil {
		ch, err = s.insertCharge(ctx, s.pool, key, req)
	}
	switch {
	case errors.Is(err, errInFlight):
		s.answer(ctx, w, rec, key, req, nil, http.StatusConflict, err)
	case errors.Is(err, errKeyReused):
		s.answer(ctx, w, rec, key, req, nil, http.StatusBadRequest, err)
	case err != nil:
		s.answer(ctx, w, rec, key, req, nil, http.StatusInternalServerError, err)
	case ch.Replayed:
		s.answer(ctx, w, rec, key, req, ch, http.StatusOK, nil)
	default:
		s.answer(ctx, w, rec, key, req, ch, http.StatusCreated, nil)
	}
}

// chargeOnce creates the key's charge or returns the one it created before. A transaction-
// scoped advisory lock on the key (and the schema: advisory locks are database-wide)
// marks it in flight for the whole request, so a concurrent same-key request gets
// errInFlight instead of waiting.
func (s *Server) chargeOnce(ctx context.Context, key string, req ChargeRequest) (*Charge, error) {
	var ch *Charge
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var got bool
		if err := tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock(hashtextextended('fakepay:' || current_schema() || ':' || $1, 0))`, key).Scan(&got); err != nil {
			return err
		}
		if !got {
			return errInFlight
		}
		prev, err := scanCharge(tx.QueryRow(ctx, selectByKey, key))
		if err == nil {
			if prev.OrderID != req.OrderID || prev.CustomerID != req.CustomerID || prev.AmountCents != req.AmountCents || prev.Currency != req.Currency {
				return errKeyReused
			}
			prev.Replayed = true
			ch = prev
			return nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		if err := s.work(ctx); err != nil {
			return err
		}
		ch, err = s.insertCharge(ctx, tx, key, req)
		return err
	})
	return ch, err
}

// work stands for the provider's processing time: a random pause up to Config.Delay.
func (s *Server) work(ctx context.Context) error {
	if s.cfg.Delay <= 0 {
		return nil
	}
	select {
	case <-time.After(rand.N(s.cfg.Delay)):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

const selectByKey = `SELECT id, coalesce(idempotency_key, ''), order_id, customer_id, amount_cents, currency, created_at
	FROM fakepay_charges WHERE idempotency_key = $1 AND honored`

const insertCharge = `INSERT INTO fakepay_charges (id, idempotency_key, order_id, customer_id, amount_cents, currency, honored)
	VALUES ($1, nullif($2, ''), $3, $4, $5, $6, $7)
	RETURNING id, coalesce(idempotency_key, ''), order_id, customer_id, amount_cents, currency, created_at`

type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

func (s *Server) insertCharge(ctx context.Context, q querier, key string, req ChargeRequest) (*Charge, error) {
	honored := s.cfg.HonorKeys && key != ""
	return scanCharge(q.QueryRow(ctx, insertCharge, newChargeID(), key, req.OrderID, req.CustomerID, req.AmountCents, req.Currency, honored))
}

func scanCharge(row pgx.Row) (*Charge, error) {
	var c Charge
	if err := row.Scan(&c.ID, &c.IdempotencyKey, &c.OrderID, &c.CustomerID, &c.AmountCents, &c.Currency, &c.CreatedAt); err != nil {
		return nil, err
	}
	return &c, nil
}

// record is what answer records of a request besides its key and body.
type record struct {
	received time.Time // when it arrived
	fence    int64     // its Idemq-Fence header, 0 for none
	fenceErr error     // why the header could not be read
}

// answer records the request and writes the response. Recording uses its own context:
// a client that hung up still leaves a trace. The cause of a 5xx is logged, and the caller
// gets errInternal instead.
func (s *Server) answer(ctx context.Context, w http.ResponseWriter, rec record, key string, req ChargeRequest, ch *Charge, code int, cause error) {
	if code >= http.StatusInternalServerError {
		s.cfg.Logger.ErrorContext(ctx, "charge request failed", "key", key, "order_id", req.OrderID, "err", cause)
		cause = errInternal
	}
	body, _ := json.Marshal(req)
	var chargeID *string
	replayed := false
	if ch != nil {
		chargeID, replayed = &ch.ID, ch.Replayed
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	var fence *int64
	if rec.fence > 0 && rec.fenceErr == nil {
		fence = &rec.fence
	}
	if _, err := s.pool.Exec(rctx, `INSERT INTO fakepay_requests (idempotency_key, order_id, body, status_code, charge_id, replayed, received_at, fence)
		VALUES (nullif($1, ''), nullif($2, ''), $3, $4, $5, $6, $7, $8)`, key, req.OrderID, body, code, chargeID, replayed, rec.received, fence); err != nil {
		s.cfg.Logger.ErrorContext(ctx, "record request", "err", err)
	}
	s.cfg.Logger.InfoContext(ctx, "charge request", "key", key, "order_id", req.OrderID, "status", code, "replayed", replayed)

	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	if cause != nil {
		json.NewEncoder(w).Encode(map[string]string{"error": cause.Error()})
		return
	}
	json.NewEncoder(w).Encode(ch)
}

func newChargeID() string {
	b := make([]byte, 12)
	if _, err := crand.Read(b); err != nil {
		panic(fmt.Sprintf("fakepay: crypto/rand: %v", err))
	}
	return "ch_" + hex.EncodeToString(b)
}
