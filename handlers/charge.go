package handlers

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/hibiken/asynq"

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

// idleConns is how many connections to the provider a default Charger keeps open.
const idleConns = 128

// Charger charges through the payment provider's HTTP API. It is safe for concurrent use.
type Charger struct {
	url  string
	http *http.Client
}

// NewCharger returns a Charger calling the provider at baseURL (e.g.
// http://127.0.0.1:8090). A nil client means one with a 30 s timeout that keeps up to
// idleConns connections to the provider open between calls.
func NewCharger(baseURL string, client *http.Client) *Charger {
	if client == nil {
		client = DefaultClient()
	}
	return &Charger{url: strings.TrimRight(baseURL, "/") + "/v1/charges", http: client}
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
// repeated call (after a crash) returns the first charge instead of making another. It
// returns the charge as JSON. A 4xx answer other than 409 is permanent (wraps
// asynq.SkipRetry); 409 returns ErrProviderBusy; transport errors and 5xx are retryable.
func (ch *Charger) Charge(ctx context.Context, key string, c tasks.Charge) (json.RawMessage, error) {
	body, err := json.Marshal(c)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ch.url, bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("charge %s: %w", key, err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := ch.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("charge %s: %w", key, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, fmt.Errorf("charge %s: read answer: %w", key, err)
	}
	switch {
	case resp.StatusCode == http.StatusConflict:
		return nil, fmt.Errorf("charge %s: %w", key, ErrProviderBusy)
	case resp.StatusCode >= 400 && resp.StatusCode < 500:
		return nil, fmt.Errorf("charge %s: provider refused (%d): %s: %w", key, resp.StatusCode, bytes.TrimSpace(raw), asynq.SkipRetry)
	case resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusCreated:
		return nil, fmt.Errorf("charge %s: provider answered %d: %s", key, resp.StatusCode, bytes.TrimSpace(raw))
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
