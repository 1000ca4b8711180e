package api

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
)

// post sends one POST /v1/charges from any goroutine; headers are name, value pairs.
func (a *testAPI) post(ctx context.Context, body string, headers ...string) (answer, error) {
	req, err := http.NewRequestWithContext(ctx, "POST", a.URL+"/v1/charges", strings.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Add(headers[i], headers[i+1])
	}
	resp, err := a.Client().Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return answer{code: resp.StatusCode, header: resp.Header, body: string(b)}, err
}

// A burst of POSTs shares transactions (intents recorded by one transaction share its
// start time, created_at's now()), and each request still gets its own answer: new jobs
// 202, repeats of a header key their replay, a reused header key with another body and an
// order accepted with another body 422, and a refused request leaves no header row.
func TestConcurrentPostsShareTransactions(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	ctx := testenv.Context(t, time.Minute)
	first := a.do(t, "POST", "/v1/charges", chargeBody("o-old", 100), "Idempotency-Key", "k-old").want(t, 202)

	type call struct {
		body    string
		headers []string
		want    int
		replay  bool // a 202 must be a replay of first
	}
	const n = 40
	var calls []call
	for i := range n {
		c := call{body: chargeBody(fmt.Sprintf("o-%d", i), 100+i), want: 202}
		if i%2 == 0 {
			c.headers = []string{"Idempotency-Key", fmt.Sprintf("k-%d", i)}
		}
		calls = append(calls, c)
	}
	for range 3 {
		calls = append(calls, call{body: chargeBody("o-old", 100), headers: []string{"Idempotency-Key", "k-old"}, want: 202, replay: true})
	}
	calls = append(calls,
		call{body: chargeBody("o-other", 100), headers: []string{"Idempotency-Key", "k-old"}, want: 422},
		call{body: chargeBody("o-old", 999), headers: []string{"Idempotency-Key", "k-mismatch"}, want: 422},
		call{body: chargeBody("o-old", 999), want: 422},
	)
	answers, errs := make([]answer, len(calls)), make([]error, len(calls))
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i, c := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			answers[i], errs[i] = a.post(ctx, c.body, c.headers...)
		}()
	}
	close(start)
	wg.Wait()
	for i, c := range calls {
		if errs[i] != nil {
			t.Fatalf("call %d: %v", i, errs[i])
		}
		ans := answers[i]
		if ans.code != c.want {
			t.Fatalf("call %d (%s %v): %d %s, want %d", i, c.body, c.headers, ans.code, ans.body, c.want)
		}
		if c.replay && (ans.body != first.body || ans.header.Get(HeaderReplayed) != "true") {
			t.Fatalf("repeat of k-old: %s (replayed %q), want %s", ans.body, ans.header.Get(HeaderReplayed), first.body)
		}
		if !c.replay && ans.header.Get(HeaderReplayed) != "" {
			t.Fatalf("call %d marked replayed: %s", i, ans.body)
		}
	}
	if got := testenv.Count(t, a.pool, `SELECT count(*) FROM job_intents WHERE idempotency_key LIKE 'charge:o-%'`); got != n+1 {
		t.Fatalf("%d intents, want %d", got, n+1)
	}
	if got := testenv.Count(t, a.pool, `SELECT count(*) FROM api_idempotency_keys WHERE status_code IS NOT NULL`); got != n/2+1 {
		t.Fatalf("%d answered header rows, want %d", got, n/2+1)
	}
	if got := testenv.Count(t, a.pool, `SELECT count(*) FROM api_idempotency_keys WHERE header_key = 'k-mismatch'`); got != 0 {
		t.Fatal("the refused request's header row was kept")
	}
	txs := testenv.Count(t, a.pool, `SELECT count(DISTINCT created_at) FROM job_intents WHERE idempotency_key LIKE 'charge:o-%' AND idempotency_key <> 'charge:o-old'`)
	if txs >= n {
		t.Fatalf("%d requests took %d transactions: none shared", n, txs)
	}
	t.Logf("%d concurrent new orders accepted in %d transactions", n, txs)
}
