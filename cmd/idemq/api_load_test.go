package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
)

// TestAPILoadEachJobTakesEffectOnce posts 20,000 debits through a real `idemq api` at 50
// concurrent clients, one in ten repeating an earlier order under a new Idempotency-Key,
// while two `idemq worker` processes drain them: every request is answered 202 (new) or
// 200 (repeat), and every accepted order takes effect exactly once.
func TestAPILoadEachJobTakesEffectOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("load test")
	}
	t.Parallel()
	s := startStack(t, 2, nil, nil)
	port := testenv.FreePort(t)
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	startIdemq(t, "api", []string{"DATABASE_URL=" + s.dsn, "REDIS_URL=" + s.redisURL,
		fmt.Sprintf("IDEMQ_HTTP_ADDR=127.0.0.1:%d", port), "IDEMQ_LOG_LEVEL=warn"}, "api")
	testenv.WaitHTTP(t, base+"/readyz", 30*time.Second)

	const requests, clients = 20000, 50
	ctx := testenv.Context(t, 5*time.Minute)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
	var next atomic.Int64
	var mu sync.Mutex
	codes := map[int]int{}
	var firstErr error
	var wg sync.WaitGroup
	started := time.Now()
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= requests {
					return
				}
				ref := i
				if i%10 == 9 {
					ref = i / 2 // an order posted before (or being posted now)
				}
				body := fmt.Sprintf(`{"account_id":"acct-%d","amount_cents":%d,"reference":"load-%d"}`, ref%13, 100+ref%900, ref)
				code, err := postOnce(ctx, client, base+"/v1/wallet/debits", body, fmt.Sprintf("hk-%d", i))
				mu.Lock()
				codes[code]++
				if err != nil && firstErr == nil {
					firstErr = err
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	t.Logf("%d requests in %s: %v", requests, time.Since(started).Round(time.Millisecond), codes)
	if firstErr != nil {
		t.Fatal(firstErr)
	}
	if codes[202]+codes[200] != requests {
		t.Fatalf("answers %v: want only 202 and 200", codes)
	}
	distinct := testenv.Count(t, s.pool, `SELECT count(*) FROM job_intents`)
	if codes[202] != distinct {
		t.Fatalf("%d accepted as new, %d intents", codes[202], distinct)
	}
	s.waitCompleted(t, distinct, 3*time.Minute)
	if n := testenv.Count(t, s.pool, `SELECT count(*) FROM wallet_entries`); n != distinct {
		t.Fatalf("%d wallet entries for %d orders", n, distinct)
	}
	if n := testenv.Count(t, s.pool, `SELECT count(*) FROM (SELECT reference FROM wallet_entries GROUP BY reference HAVING count(*) > 1) d`); n != 0 {
		t.Fatalf("%d orders took effect more than once", n)
	}
}

// postOnce posts body with an Idempotency-Key and returns the status.
func postOnce(ctx context.Context, c *http.Client, url, body, key string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, "POST", url, strings.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := c.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 202 && resp.StatusCode != 200 {
		var e struct{ Error string }
		json.Unmarshal(b, &e)
		return resp.StatusCode, fmt.Errorf("POST %s: %d %s", body, resp.StatusCode, e.Error)
	}
	return resp.StatusCode, nil
}
