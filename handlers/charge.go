package handlers

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/tasks"
)

// ChargeResult is what a completed payment:charge records: the provider's charge.
type ChargeResult struct {
	ChargeID    string `json:"charge_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
	// Replayed is true when the provider answered with a charge made by an earlier call
	// with the same key (a retry after a crash between the call and the completion).
	Replayed bool `json:"replayed"`
}

// ErrProviderBusy reports that the provider is still processing another request with the
// same idempotency key (HTTP 409); a later retry gets the outcome.
var ErrProviderBusy = errors.New("handlers: provider is processing a request with this key")

// ErrLeaseEnding reports that too little of the handler's lease is left to call the
// provider (see Charger.Charge): the charge is not attempted, and a retry, after the
// lease, calls under a fresh one.
var ErrLeaseEnding = errors.New("handlers: too little of the lease is left to call the provider")

// HeaderFence is the request header carrying the fence of the claim a call is made under,
// for the provider's records (never part of the idempotency key).
const HeaderFence = "Idemq-Fence"

// HeaderKey is the request header carrying the call's key, for the records of an
// endpoint that honours no idempotency key (the receipt's). It is not Idempotency-Key on
// purpose: Go's transport treats a POST with that header as safe to send again by itself
// when a reused connection breaks, and such an endpoint would then act twice.
const HeaderKey = "Idemq-Key"

// errNotResent is what a call returns when its connection broke after the request may
// have reached the provider: the transport does not send it again on its own.
var errNotResent = errors.New("the connection broke after the request was sent; not sent again by this call (the job's retry sends it under its claim)")

const (
	// idleConns is how many connections to the provider a default Charger keeps open.
	idleConns = 128
	// callTimeout bounds a provider call.
	callTimeout = 30 * time.Second
	// MinCallTime is the least time a provider call is started with (or the fence margin,
	// when that is shorter: a short lease).
	MinCallTime = time.Second
	// DefaultFenceMargin is a Charger's default fence margin: the default ledger's
	// idempotency.Config.SelfFenceMargin (a tenth of its 30 s lease).
	DefaultFenceMargin = 3 * time.Second
)

// Charger charges through the payment provider's HTTP API. It is safe for concurrent use.
type Charger struct {
	url    string // POST /v1/charges
	emails string // POST /v1/emails
	http   *http.Client
	margin time.Duration
}

// NewCharger returns a Charger calling the provider at baseURL (e.g.
// http://127.0.0.1:8090). A nil client means one with a 30 s timeout that keeps up to
// idleConns connections to the provider open between calls. Its fence margin is
// DefaultFenceMargin (see WithFenceMargin).
func NewCharger(baseURL string, client *http.Client) *Charger {
	if client == nil {
		client = DefaultClient()
	}
	base := strings.TrimRight(baseURL, "/")
	return &Charger{url: base + "/v1/charges", emails: base + "/v1/emails", http: client, margin: DefaultFenceMargin}
}

// WithFenceMargin returns a copy of ch whose calls under a lease end margin before the
// handler's self-fence deadline (idempotency.LeaseDeadline). Give it the ledger's
// Ledger.SelfFenceMargin: the lease then ends twice the margin after the call's deadline,
// time for the provider to finish a request whose caller hung up before anyone else may
// take the key over.
func (ch *Charger) WithFenceMargin(margin time.Duration) *Charger {
	c := *ch
	c.margin = margin
	return &c
}

// DefaultClient is the HTTP client NewCharger uses when given none: a 30 s timeout, and
// Go's default transport keeping enough idle connections for a worker's concurrent charges
// (its default keeps two per host: a worker running more charges at once would open and
// close a connection for most calls). Wrap its transport to trace the calls
// (otelhttp.NewTransport makes a client span per call whose traceparent the provider
// receives, under the delivery's span).
func DefaultClient() *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns, tr.MaxIdleConnsPerHost = idleConns, idleConns
	return &http.Client{Timeout: 30 * time.Second, Transport: tr}
}

// Charge asks the provider to charge c, passing key as its Idempotency-Key, so that a
// repeated call (after a crash) returns the first charge instead of making another, and
// the claim's fence as HeaderFence. It returns the charge as JSON. A 4xx answer other
// than 409 is permanent (wraps asynq.SkipRetry); 409 returns ErrProviderBusy; transport
// errors and 5xx are retryable.
//
// Under a ledger lease the call's deadline is min(30 s, LeaseDeadline - now - the fence
// margin), so that the call ends while the lease surely holds; with less than
// min(MinCallTime, the fence margin) of it left, Charge returns ErrLeaseEnding
// (retryable) without calling.
func (ch *Charger) Charge(ctx context.Context, key string, c tasks.Charge) (json.RawMessage, error) {
	raw, err := ch.post(ctx, ch.url, "charge", "Idempotency-Key", key, c)
	if err != nil {
		return nil, err
	}
	var got struct {
		ID          string `json:"id"`
		AmountCents int64  `json:"amount_cents"`
		Currency    string `json:"currency"`
		Replayed    bool   `json:"replayed"`
	}
	if err := json.Unmarshal(raw, &got); err != nil || got.ID == "" {
		return nil, fmt.Errorf("charge %s: unreadable provider answer %.200q", key, raw)
	}
	return json.Marshal(ChargeResult{ChargeID: got.ID, AmountCents: got.AmountCents, Currency: got.Currency, Replayed: got.Replayed})
}

// post sends body as JSON to url with key in keyHeader (and the claim's fence), within
// the lease's self-fence deadline as Charge describes, and returns a 2xx answer's body.
// what names the call in errors.
//
// A call sends at most one request that may have reached the provider: when a reused
// connection breaks after the request was written, the transport does not send it again
// (it would for a POST with Idempotency-Key, net/http's rule for a replayable request),
// the call fails, and the job's retry sends it again under a claim the ledger checks. A
// request that never left (nothing written) is still retried on a new connection.
func (ch *Charger) post(ctx context.Context, url, what, keyHeader, key string, body any) ([]byte, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	timeout := callTimeout
	if fenceAt, ok := idempotency.LeaseDeadline(ctx); ok {
		if left := time.Until(fenceAt) - ch.margin; left < timeout {
			timeout = left
		}
		if least := min(MinCallTime, ch.margin); timeout < least {
			return nil, fmt.Errorf("%s %s: %s left before the lease's self-fence deadline, less than %s and the margin %s: %w",
				what, key, time.Until(fenceAt).Round(time.Millisecond), least, ch.margin, ErrLeaseEnding)
		}
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(b))
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", what, key, err)
	}
	// The transport asks for the body again only to resend a request it already sent
	// (an unsent one is sent with the body it has): refuse.
	req.GetBody = func() (io.ReadCloser, error) { return nil, errNotResent }
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(keyHeader, key)
	if _, fence, ok := idempotency.FromContext(ctx); ok && fence > 0 {
		req.Header.Set(HeaderFence, strconv.FormatInt(fence, 10))
	}
	resp, err := ch.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", what, key, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, fmt.Errorf("%s %s: read answer: %w", what, key, err)
	}
	switch {
	case resp.StatusCode == http.StatusConflict:
		return nil, fmt.Errorf("%s %s: %w", what, key, ErrProviderBusy)
	case resp.StatusCode >= 400 && resp.StatusCode < 500:
		return nil, fmt.Errorf("%s %s: provider refused (%d): %s: %w", what, key, resp.StatusCode, bytes.TrimSpace(raw), asynq.SkipRetry)
	case resp.StatusCode < 200 || resp.StatusCode > 299:
		return nil, fmt.Errorf("%s %s: provider answered %d: %s", what, key, resp.StatusCode, bytes.TrimSpace(raw))
	}
	return raw, nil
}
