package api

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/metrics"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// testAPI is the API on a private Postgres schema and Redis database, served by httptest.
type testAPI struct {
	*httptest.Server
	s        *Server
	pool     *pgxpool.Pool
	rdb      *redis.Client
	ledger   *idempotency.Ledger
	client   *outbox.Client
	metrics  *metrics.Metrics
	redisURL string
}

func newTestAPI(t *testing.T, opts *Options) *testAPI {
	t.Helper()
	return newTestAPIOn(t, testenv.Postgres(t), opts)
}

// newTestAPIOn is newTestAPI on pool, a migrated database.
func newTestAPIOn(t *testing.T, pool *pgxpool.Pool, opts *Options) *testAPI {
	t.Helper()
	rurl := testenv.RedisURL(t)
	rdb := testenv.RedisClient(t, rurl)
	ledger := idempotency.New(pool, nil)
	t.Cleanup(ledger.Close)
	client := outbox.NewClient(pool, rdb, &outbox.Config{RelayPoll: 100 * time.Millisecond})
	// Like `idemq api`, run a relay: what the API accepts reaches Redis.
	relayCtx, stopRelay := context.WithCancel(context.Background())
	relayDone := make(chan struct{})
	go func() {
		defer close(relayDone)
		client.RunRelay(relayCtx)
	}()
	t.Cleanup(func() {
		stopRelay()
		<-relayDone
	})
	m := metrics.New()
	connOpt, err := asynq.ParseRedisURI(rurl)
	if err != nil {
		t.Fatal(err)
	}
	o := Options{}
	if opts != nil {
		o = *opts
	}
	o.RedisConnOpt = connOpt
	srv := httptest.NewUnstartedServer(nil)
	if o.ListenAddr == "" {
		o.ListenAddr = srv.Listener.Addr().String() // loopback: the dashboard needs no password
	}
	s := New(Deps{Pool: pool, Redis: rdb, Ledger: ledger, Enqueuer: client, Metrics: m}, &o)
	srv.Config.Handler = s
	srv.Start()
	t.Cleanup(func() {
		srv.Close()
		s.Close()
	})
	return &testAPI{Server: srv, s: s, pool: pool, rdb: rdb, ledger: ledger, client: client, metrics: m, redisURL: rurl}
}

type answer struct {
	code   int
	header http.Header
	body   string
	json   map[string]any
}

// do sends a request; headers are name, value pairs (Host sets the request's). A POST to /v1/ says its body is
// application/json unless headers give a Content-Type ("" sends none).
func (a *testAPI) do(t *testing.T, method, path, body string, headers ...string) answer {
	t.Helper()
	req, err := http.NewRequestWithContext(testenv.Context(t, 30*time.Second), method, a.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if method == "POST" && strings.HasPrefix(path, "/v1/") {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(headers); i += 2 {
		if http.CanonicalHeaderKey(headers[i]) == "Host" {
			req.Host = headers[i+1]
			continue
		}
		if http.CanonicalHeaderKey(headers[i]) == "Content-Type" {
			req.Header.Del("Content-Type")
			if headers[i+1] == "" {
				continue
			}
		}
		req.Header.Add(headers[i], headers[i+1])
	}
	resp, err := a.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	ans := answer{code: resp.StatusCode, header: resp.Header, body: string(b)}
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") {
		json.Unmarshal(b, &ans.json)
	}
	return ans
}

func (a answer) want(t *testing.T, code int, contains ...string) answer {
	t.Helper()
	if a.code != code {
		t.Fatalf("status %d, want %d; body %s", a.code, code, a.body)
	}
	for _, c := range contains {
		if !strings.Contains(a.body, c) {
			t.Fatalf("body %s does not contain %q", a.body, c)
		}
	}
	return a
}

func (a answer) wantError(t *testing.T, code int, contains string) {
	t.Helper()
	a.want(t, code)
	msg, ok := a.json["error"].(string)
	if !ok || !strings.Contains(msg, contains) {
		t.Fatalf(`body %s: want {"error": "...%s..."}`, a.body, contains)
	}
}

func chargeBody(order string, amount int) string {
	b, _ := json.Marshal(map[string]any{"order_id": order, "customer_id": "c-1", "amount_cents": amount, "currency": "EUR"})
	return string(b)
}

func (a *testAPI) intents(t *testing.T, key string) int {
	t.Helper()
	var n int
	if err := a.pool.QueryRow(testenv.Context(t, 10*time.Second), `SELECT count(*) FROM job_intents WHERE idempotency_key = $1`, key).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestBadRequests(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	long := strings.Repeat("k", 256)
	for _, tc := range []struct {
		name, path, body string
		headers          []string
		code             int
		msg              string
	}{
		{"malformed JSON", "/v1/charges", `{"order_id":`, nil, 400, "malformed JSON"},
		{"not an object", "/v1/charges", `[1,2]`, nil, 400, "JSON object"},
		{"empty body", "/v1/charges", ``, nil, 400, "empty"},
		{"trailing data", "/v1/charges", chargeBody("o-1", 5) + `{}`, nil, 400, "data after"},
		{"unknown field", "/v1/charges", `{"order_id":"o-1","customer_id":"c","amount_cents":5,"currency":"EUR","amount":5}`, nil, 422, "amount: unknown field"},
		{"wrong type", "/v1/charges", `{"order_id":"o-1","customer_id":"c","amount_cents":"5","currency":"EUR"}`, nil, 422, "amount_cents: must be a JSON whole number"},
		{"missing order", "/v1/charges", `{"customer_id":"c","amount_cents":5,"currency":"EUR"}`, nil, 422, "order_id: required"},
		{"zero amount", "/v1/charges", `{"order_id":"o-1","customer_id":"c","amount_cents":0,"currency":"EUR"}`, nil, 422, "amount_cents"},
		{"amount over the maximum", "/v1/charges", `{"order_id":"o-1","customer_id":"c","amount_cents":100000000000,"currency":"EUR"}`, nil, 422, "amount_cents: must be a positive whole number of cents, at most 99999999999, got 100000000000"},
		{"int64's maximum amount", "/v1/wallet/debits", `{"account_id":"a-1","amount_cents":9223372036854775807,"reference":"r"}`, nil, 422, "at most 99999999999"},
		{"50,000-digit amount", "/v1/charges", `{"order_id":"o-1","customer_id":"c","amount_cents":` + "9" + strings.Repeat("0", 49_999) + `,"currency":"EUR"}`, nil, 422, "at most 99999999999, got 900000000000000000000000… (50000 characters)"},
		{"50,000-digit float", "/v1/charges", `{"order_id":"o-1","customer_id":"c","amount_cents":` + "9" + strings.Repeat("0", 49_997) + `.5,"currency":"EUR"}`, nil, 422, "amount_cents: must be a JSON whole number, got number 900000000000000000000000… (50000 characters)"},
		{"bad currency", "/v1/charges", `{"order_id":"o-1","customer_id":"c","amount_cents":5,"currency":"EURO"}`, nil, 422, "currency: must be a three-letter ISO 4217 code"},
		{"space in order", "/v1/charges", `{"order_id":"o 1","customer_id":"c","amount_cents":5,"currency":"EUR"}`, nil, 422, "order_id"},
		{"missing reference", "/v1/wallet/debits", `{"account_id":"a-1","amount_cents":5}`, nil, 422, "reference: required"},
		{"debit unknown field", "/v1/wallet/debits", `{"account_id":"a-1","amount_cents":5,"reference":"r","x":1}`, nil, 422, "x: unknown field"},
		{"oversized body", "/v1/charges", `{"order_id":"` + strings.Repeat("x", DefaultMaxBodyBytes) + `"}`, nil, 413, "body: larger than"},
		{"empty header", "/v1/charges", chargeBody("o-1", 5), []string{"Idempotency-Key", ""}, 400, "Idempotency-Key: empty"},
		{"empty quoted header", "/v1/charges", chargeBody("o-1", 5), []string{"Idempotency-Key", `""`}, 400, "Idempotency-Key: empty"},
		{"long header", "/v1/charges", chargeBody("o-1", 5), []string{"Idempotency-Key", long}, 400, "Idempotency-Key: 256 bytes"},
		{"non-printable header", "/v1/charges", chargeBody("o-1", 5), []string{"Idempotency-Key", "a\tb"}, 400, "not printable"},
		{"two headers", "/v1/charges", chargeBody("o-1", 5), []string{"Idempotency-Key", "a", "Idempotency-Key", "b"}, 400, "one value"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := a.do(t, "POST", tc.path, tc.body, tc.headers...)
			got.wantError(t, tc.code, tc.msg)
			if len(got.body) > 400 {
				t.Fatalf("answer is %d bytes, want a short error (the value cut): %.400s", len(got.body), got.body)
			}
		})
	}
	if n := a.intents(t, "charge:o-1"); n != 0 {
		t.Fatalf("%d intents recorded by refused requests, want 0", n)
	}
	a.do(t, "GET", "/v1/nope", "").wantError(t, 404, "no route")
}

func TestAcceptDuplicateMismatchWithoutHeader(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	first := a.do(t, "POST", "/v1/charges", chargeBody("o-1", 1999), "Content-Type", "application/json").
		want(t, 202, `"key":"charge:o-1"`, `"status":"accepted"`, `"duplicate":false`)
	if first.json["type"] != tasks.TypeCharge {
		t.Fatalf("type %v, want %s", first.json["type"], tasks.TypeCharge)
	}
	// The same order, the same body in another layout: a duplicate.
	a.do(t, "POST", "/v1/charges", `{ "currency":"EUR", "amount_cents":1999, "customer_id":"c-1", "order_id":"o-1" }`).
		want(t, 200, `"key":"charge:o-1"`, `"duplicate":true`)
	// The same order with another amount: 422, naming the field that makes the key.
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 2000)).wantError(t, 422, `order_id: job "charge:o-1" was already accepted with a different body`)
	if n := a.intents(t, "charge:o-1"); n != 1 {
		t.Fatalf("%d intents for charge:o-1, want 1", n)
	}

	// The body must be declared JSON; parameters are allowed.
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 1999), "Content-Type", "application/json; charset=utf-8").want(t, 200, `"duplicate":true`)

	// Debits work the same way, keyed by reference.
	a.do(t, "POST", "/v1/wallet/debits", `{"account_id":"a-1","amount_cents":500,"reference":"r-1"}`).want(t, 202, `"key":"debit:r-1"`)
	a.do(t, "POST", "/v1/wallet/debits", `{"account_id":"a-1","amount_cents":500,"reference":"r-1"}`).want(t, 200, `"duplicate":true`)
	a.do(t, "POST", "/v1/wallet/debits", `{"account_id":"a-2","amount_cents":500,"reference":"r-1"}`).wantError(t, 422, "reference: ")

	// Accepted, not yet claimed by a worker: the intent answers.
	job := a.do(t, "GET", "/v1/jobs/charge:o-1", "").want(t, 200, `"key":"charge:o-1"`, `"status":"accepted"`, `"type":"payment:charge"`)
	if in := job.json["intent"]; in != outbox.IntentPending && in != outbox.IntentPublished {
		t.Fatalf("intent %v, want pending or published", in)
	}
	a.do(t, "GET", "/v1/jobs/charge:nope", "").wantError(t, 404, `no job with key "charge:nope"`)
	a.do(t, "GET", "/v1/jobs/has%20space", "").wantError(t, 404, "no job with key")
}

func TestIdempotencyKeyHeader(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	first := a.do(t, "POST", "/v1/charges", chargeBody("o-1", 1999), "Idempotency-Key", "k-1").want(t, 202, `"key":"charge:o-1"`)
	if first.header.Get(HeaderReplayed) != "" {
		t.Fatalf("first answer carries %s", HeaderReplayed)
	}
	// A repeat gets the same answer, byte for byte, marked as replayed.
	again := a.do(t, "POST", "/v1/charges", chargeBody("o-1", 1999), "Idempotency-Key", "k-1").want(t, 202)
	if again.body != first.body || again.header.Get(HeaderReplayed) != "true" {
		t.Fatalf("replay: %d %q (replayed %q), want %q", again.code, again.body, again.header.Get(HeaderReplayed), first.body)
	}
	// The quoted structured-field form is the same key.
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 1999), "Idempotency-Key", `"k-1"`).want(t, 202)
	// The same header key with another body: 422, whatever order it names.
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 2000), "Idempotency-Key", "k-1").wantError(t, 422, `Idempotency-Key "k-1" was used with a different body`)
	a.do(t, "POST", "/v1/charges", chargeBody("o-2", 1999), "Idempotency-Key", "k-1").wantError(t, 422, "different body")
	if n := a.intents(t, "charge:o-2"); n != 0 {
		t.Fatalf("a refused header reuse recorded %d intents for charge:o-2", n)
	}
	// Another header key for the same order: never a second job.
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 1999), "Idempotency-Key", "k-2").want(t, 200, `"key":"charge:o-1"`, `"duplicate":true`)
	// ... and another header key with another body for the same order: the job key's mismatch.
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 2000), "Idempotency-Key", "k-3").wantError(t, 422, "order_id: ")
	if n := a.intents(t, "charge:o-1"); n != 1 {
		t.Fatalf("%d intents for charge:o-1 after two header keys, want 1", n)
	}
	// A header key is scoped to its route.
	a.do(t, "POST", "/v1/wallet/debits", `{"account_id":"a-1","amount_cents":500,"reference":"r-1"}`, "Idempotency-Key", "k-1").want(t, 202, `"key":"debit:r-1"`)
	a.do(t, "POST", "/v1/charges", chargeBody("o-4", 1999), "Idempotency-Key", "caf\xc3\xa9").wantError(t, 400, "not printable ASCII")
	// The refused k-3 left no row: it can be used for something else.
	a.do(t, "POST", "/v1/charges", chargeBody("o-3", 1999), "Idempotency-Key", "k-3").want(t, 202, `"key":"charge:o-3"`)
}

func TestConcurrentRepeatIsConflict(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	a.s.holdAccept = func(ctx context.Context) {
		held := false
		once.Do(func() { held = true })
		if held {
			close(entered)
			<-release
		}
	}
	firstDone := make(chan answer, 1)
	go func() { firstDone <- a.do(t, "POST", "/v1/charges", chargeBody("o-1", 1999), "Idempotency-Key", "k-1") }()
	<-entered
	// The first request is inside its transaction: a repeat of its header key gets 409.
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 1999), "Idempotency-Key", "k-1").wantError(t, 409, "still being accepted")
	close(release)
	first := <-firstDone
	first.want(t, 202, `"key":"charge:o-1"`)
	again := a.do(t, "POST", "/v1/charges", chargeBody("o-1", 1999), "Idempotency-Key", "k-1").want(t, 202)
	if again.body != first.body {
		t.Fatalf("replay after the conflict %q, want %q", again.body, first.body)
	}
	if n := a.intents(t, "charge:o-1"); n != 1 {
		t.Fatalf("%d intents, want 1", n)
	}
}

func TestConcurrentHeaderKeysMakeOneJob(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	const n = 8
	var wg sync.WaitGroup
	codes := make([]int, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			codes[i] = a.do(t, "POST", "/v1/charges", chargeBody("o-1", 1999), "Idempotency-Key", "k-"+string(rune('a'+i))).code
		}()
	}
	wg.Wait()
	accepted := 0
	for _, c := range codes {
		switch c {
		case 202:
			accepted++
		case 200, 409:
		default:
			t.Fatalf("codes %v: unexpected %d", codes, c)
		}
	}
	if accepted != 1 {
		t.Fatalf("codes %v: %d accepted, want exactly 1", codes, accepted)
	}
	if got := a.intents(t, "charge:o-1"); got != 1 {
		t.Fatalf("%d intents, want 1", got)
	}
}

func TestDuplicateCarriesResultOnceDone(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	body := `{"account_id":"a-1","amount_cents":500,"reference":"r-1"}`
	a.do(t, "POST", "/v1/wallet/debits", body).want(t, 202, `"key":"debit:r-1"`)

	// A worker's delivery, as the transactional middleware runs it.
	spec, err := tasks.DebitSpec(tasks.Debit{AccountID: "a-1", AmountCents: 500, Reference: "r-1"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := testenv.Context(t, 30*time.Second)
	_, err = a.ledger.DoTx(ctx, idempotency.Request{Key: spec.Key, TaskType: spec.Type, Fingerprint: idempotency.Fingerprint(spec.Type, spec.Payload)},
		func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			return json.RawMessage(`{"entry_id":7,"balance_cents":-500}`), nil
		})
	if err != nil {
		t.Fatal(err)
	}
	dup := a.do(t, "POST", "/v1/wallet/debits", body).want(t, 200, `"key":"debit:r-1"`, `"status":"completed"`, `"duplicate":true`, `"result":{"entry_id":7,"balance_cents":-500}`)
	if dup.json["fence"] == nil || dup.json["attempts"] == nil {
		t.Fatalf("duplicate without fence or attempts: %s", dup.body)
	}
	job := a.do(t, "GET", "/v1/jobs/debit:r-1", "").want(t, 200, `"status":"completed"`, `"type":"wallet:debit"`, `"result":{"entry_id":7,"balance_cents":-500}`, `"attempts":1`)
	if f, _ := job.json["fence"].(float64); f <= 0 {
		t.Fatalf("fence %v, want > 0", job.json["fence"])
	}
}

func TestHealthAndMetrics(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	a.do(t, "GET", "/healthz", "").want(t, 200, "ok")
	a.do(t, "GET", "/readyz", "").want(t, 200, "ready")
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 5)).want(t, 202)
	a.do(t, "POST", "/v1/charges", chargeBody("o-1", 5)).want(t, 200)
	a.do(t, "POST", "/v1/charges", `{`).want(t, 400)
	a.do(t, "GET", "/v1/jobs/charge:zz", "").want(t, 404)
	a.do(t, "GET", "/metrics", "").want(t, 200,
		`idemq_api_requests_total{code="202",route="POST /v1/charges"} 1`,
		`idemq_api_requests_total{code="200",route="POST /v1/charges"} 1`,
		`idemq_api_requests_total{code="400",route="POST /v1/charges"} 1`,
		`idemq_api_requests_total{code="404",route="GET /v1/jobs/{key...}"} 1`,
		`idemq_api_requests_total{code="200",route="GET /readyz"} 1`,
	)
}
