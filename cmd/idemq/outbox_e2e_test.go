package main

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
)

// startAPI starts `idemq api` on a free port and returns its base URL.
func startAPI(t *testing.T, env []string) string {
	t.Helper()
	port := testenv.FreePort(t)
	startIdemq(t, "api", append([]string{fmt.Sprintf("IDEMQ_HTTP_ADDR=127.0.0.1:%d", port)}, env...), "api")
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	testenv.WaitHTTP(t, base+"/healthz", 30*time.Second)
	return base
}

// postCharges sends n charges through the API, 8 at a time, and returns how many were
// answered 202.
func postCharges(t *testing.T, api, prefix string, n int) int {
	t.Helper()
	var wg sync.WaitGroup
	var mu sync.Mutex
	accepted := 0
	sem := make(chan struct{}, 8)
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			body := fmt.Sprintf(`{"order_id":"%s-%d","customer_id":"c-%d","amount_cents":%d,"currency":"EUR"}`, prefix, i, i%25, 100+i)
			resp, err := http.Post(api+"/v1/charges", "application/json", strings.NewReader(body))
			if err != nil {
				t.Errorf("POST: %v", err)
				return
			}
			resp.Body.Close()
			if resp.StatusCode == http.StatusAccepted {
				mu.Lock()
				accepted++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return accepted
}

// checkOncePerOrder fails unless each of the n orders with prefix has exactly one charge
// and one completed ledger row naming it.
func checkOncePerOrder(t *testing.T, s *stack, prefix string, n int) {
	t.Helper()
	ctx := testenv.Context(t, 10*time.Second)
	var orders, charges, maxPer, named int
	s.pool.QueryRow(ctx, `SELECT count(DISTINCT order_id), count(*), coalesce(max(n), 0) FROM
		(SELECT order_id, count(*) OVER (PARTITION BY order_id) n FROM fakepay_charges WHERE order_id LIKE $1 || '-%') x`, prefix).Scan(&orders, &charges, &maxPer)
	s.pool.QueryRow(ctx, `SELECT count(*) FROM processed_jobs p JOIN fakepay_charges c ON c.id = p.result->>'charge_id'
		WHERE p.status = 'completed' AND c.order_id LIKE $1 || '-%'`, prefix).Scan(&named)
	if orders != n || charges != n || maxPer != 1 || named != n {
		t.Fatalf("%s: %d orders charged, %d charges (max %d per order), %d completed rows naming their charge; want %d, %d, 1, %d",
			prefix, orders, charges, maxPer, named, n, n, n)
	}
}

func TestOutboxSurvivesRedisLosingEverything(t *testing.T) {
	t.Parallel()
	redisSrv := testenv.StartRedis(t, testenv.PersistNone)
	const n = 500
	// A slow provider (up to 100 ms a charge) and few workers: most jobs still wait in
	// Redis when it dies. The provider does not honour keys: a second charge would show.
	s := startStack(t, 2, []string{"IDEMQ_FAKEPAY_HONOR_KEYS=false", "IDEMQ_FAKEPAY_DELAY=100ms"},
		[]string{"REDIS_URL=" + redisSrv.URL, "IDEMQ_CONCURRENCY=4"})
	api := startAPI(t, s.workerEnv)

	if got := postCharges(t, api, "lost", n); got != n {
		t.Fatalf("%d of %d accepted", got, n)
	}
	ctx := testenv.Context(t, 4*time.Minute)
	for count := 0; ; time.Sleep(50 * time.Millisecond) {
		s.pool.QueryRow(ctx, `SELECT count(*) FROM job_intents WHERE state = 'pending'`).Scan(&count)
		if count == 0 {
			break
		}
	}
	var before int
	s.pool.QueryRow(ctx, `SELECT count(*) FROM processed_jobs WHERE status = 'completed'`).Scan(&before)
	if err := redisSrv.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := redisSrv.Start(); err != nil { // empty: no persistence
		t.Fatal(err)
	}
	restarted := time.Now()
	s.waitCompleted(t, n, 3*time.Minute)
	recovery := time.Since(restarted)
	checkOncePerOrder(t, s, "lost", n)
	var republished int
	s.pool.QueryRow(ctx, `SELECT count(*) FROM job_intents WHERE publish_generation > 0`).Scan(&republished)
	t.Logf("Redis killed with %d of %d accepted jobs completed and restarted empty: %d republished, all %d completed exactly once %s after the restart",
		before, n, republished, n, recovery.Round(100*time.Millisecond))
	if republished == 0 {
		t.Fatal("nothing was republished: the test did not lose any task")
	}
}

func TestOutboxAcceptsWhileRedisIsDown(t *testing.T) {
	t.Parallel()
	redisSrv := testenv.StartRedis(t, testenv.PersistNone)
	const n = 100
	s := startStack(t, 2, []string{"IDEMQ_FAKEPAY_HONOR_KEYS=false"}, []string{"REDIS_URL=" + redisSrv.URL})
	api := startAPI(t, s.workerEnv)

	if err := redisSrv.Kill(); err != nil {
		t.Fatal(err)
	}
	down := time.Now()
	if got := postCharges(t, api, "down", n); got != n {
		t.Fatalf("while Redis was down, %d of %d accepted", got, n)
	}
	time.Sleep(10*time.Second - time.Since(down))
	if err := redisSrv.Start(); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	s.waitCompleted(t, n, 2*time.Minute)
	checkOncePerOrder(t, s, "down", n)
	t.Logf("Redis down for 10 s: all %d requests answered 202, all completed exactly once %s after Redis came back",
		n, time.Since(back).Round(100*time.Millisecond))
}
