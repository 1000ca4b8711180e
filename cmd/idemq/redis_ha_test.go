package main

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/internal/dial"
	"github.com/idemq/idemq/internal/localserver"
	"github.com/idemq/idemq/internal/testenv"
)

// haLoad posts debits and charges through the API at about rate per second until ctx
// ends, and returns the orders it got 202 for, and any other answer as an error.
func haLoad(ctx context.Context, base string, rate int) (debits, charges []string, errs []error) {
	r := haLoadRefusing(ctx, base, rate)
	return r.debits, r.charges, append(r.errs, r.refused...)
}

// haResult is what haLoadRefusing posted.
type haResult struct {
	debits, charges []string // references and orders answered 202
	refused         []error  // 503 answers: not accepted, to be retried by the client
	errs            []error  // anything else
}

// haLoadRefusing is haLoad that keeps 503 answers (the API's "try again") apart.
func haLoadRefusing(ctx context.Context, base string, rate int) (r haResult) {
	// The token of startHAStack's api; an api on loopback without one ignores it.
	client := &http.Client{Timeout: 15 * time.Second, Transport: bearerTransport(tokenA)}
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			wg.Wait()
			return r
		case <-tick.C:
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ref := fmt.Sprintf("ha-%d", i)
			path, body := "/v1/wallet/debits", fmt.Sprintf(`{"account_id":"acct-%d","amount_cents":%d,"reference":"%s"}`, i%7, 100+i, ref)
			if i%2 == 1 {
				path, body = "/v1/charges", fmt.Sprintf(`{"order_id":"%s","customer_id":"cus-%d","amount_cents":%d,"currency":"EUR"}`, ref, i%5, 100+i)
			}
			code, err := postOnce(context.Background(), client, base+path, body, "hk-"+ref)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case code == 503:
				r.refused = append(r.refused, err)
			case err != nil:
				r.errs = append(r.errs, err)
			case code == 202 && i%2 == 0:
				r.debits = append(r.debits, ref)
			case code == 202:
				r.charges = append(r.charges, ref)
			default:
				r.errs = append(r.errs, fmt.Errorf("POST %s: %d", path, code))
			}
		}()
	}
}

// failOn reports errs and stops the test when there are any.
func failOn(t *testing.T, errs []error) {
	t.Helper()
	for _, err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		t.FailNow()
	}
}

// checkEachOnce fails unless each of the debits (references) has one wallet entry and each
// of the charges (orders) one provider charge.
func (s *stack) checkEachOnce(t *testing.T, debits, charges []string) {
	t.Helper()
	if n := testenv.Count(t, s.pool, `SELECT count(*) FROM wallet_entries WHERE reference = ANY($1)`, debits); n != len(debits) {
		t.Fatalf("%d wallet entries for %d accepted debits", n, len(debits))
	}
	if n := testenv.Count(t, s.pool, `SELECT count(*) FROM fakepay_charges WHERE order_id = ANY($1)`, charges); n != len(charges) {
		t.Fatalf("%d provider charges for %d accepted charges", n, len(charges))
	}
}

// startHAStack starts fakepay, two workers and `idemq api` on the Redis at redisURL (a
// cluster's when cluster), and returns the stack, the API's base URL and process, and a
// client of that Redis.
func startHAStack(t *testing.T, ctx context.Context, redisURL string, cluster bool) (*stack, string, *proc, redis.UniversalClient) {
	t.Helper()
	rdb, err := dial.Redis(ctx, redisURL, cluster)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	env := []string{"REDIS_URL=" + redisURL, fmt.Sprintf("IDEMQ_REDIS_CLUSTER=%v", cluster)}
	s := startStackOn(t, 2, redisURL, rdb, nil, env[1:])
	port := testenv.FreePort(t)
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	api := startIdemq(t, "api", append(env, "DATABASE_URL="+s.dsn, fmt.Sprintf("IDEMQ_HTTP_ADDR=127.0.0.1:%d", port),
		"IDEMQ_LOG_LEVEL=warn", "IDEMQ_DASHBOARD_USER=ops", "IDEMQ_DASHBOARD_PASSWORD=pw", "IDEMQ_API_TOKEN="+tokenA), "api")
	testenv.WaitHTTP(t, base+"/readyz", 30*time.Second)
	return s, base, api, rdb
}

// TestSentinelFailoverUnderLoad runs `idemq api` and two `idemq worker` processes on a
// Sentinel-monitored Redis (REDIS_URL in go-redis's failover form) and SIGKILLs the
// master while debits and charges are posted through the API; the Sentinels promote the
// replica. Every request is accepted, and every accepted job takes effect exactly once:
// what the dead master had not replicated is republished by the outbox (the new master's
// run_id tells the reconciler at once). The test logs how long Redis refused writes and
// how long every job took to complete.
func TestSentinelFailoverUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("starts five Redis servers")
	}
	t.Parallel()
	takeStackSlot(t)
	g, err := localserver.StartSentinels()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Close)
	ctx := testenv.Context(t, 5*time.Minute)
	s, base, _, rdb := startHAStack(t, ctx, g.URL, false)

	loadCtx, stopLoad := context.WithCancel(ctx)
	type loadResult struct {
		debits, charges []string
		errs            []error
	}
	loaded := make(chan loadResult, 1)
	go func() {
		d, c, e := haLoad(loadCtx, base, 40)
		loaded <- loadResult{d, c, e}
	}()

	time.Sleep(3 * time.Second)
	old := g.Master.Addr
	killed := time.Now()
	if err := g.Master.Kill(); err != nil {
		t.Fatal(err)
	}
	// Writable again once the Sentinels promoted the replica and the client found it.
	var writable time.Duration
	for writable == 0 {
		if err := rdb.Set(ctx, "idemq:probe", killed.String(), time.Minute).Err(); err == nil {
			writable = time.Since(killed)
		} else if time.Since(killed) > time.Minute {
			t.Fatalf("Redis not writable a minute after the master died: %v", err)
		} else {
			time.Sleep(50 * time.Millisecond)
		}
	}
	// Every Sentinel learns of the promotion within seconds of the one that made it.
	var master string
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		master, err = g.CurrentMaster(ctx)
		if err == nil && master != old {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the Sentinels still name %q (%v) as the master; the dead one was %s", master, err, old)
		}
	}
	// The new master has another run_id: the reconcilers check every published job at once.
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		noticed := false
		for _, w := range s.workers {
			noticed = noticed || strings.Contains(w.tail(1<<20), `reason="run_id changed"`)
		}
		if noticed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no reconciler noticed the failover (run_id changed) within 20 s")
		}
	}
	time.Sleep(3 * time.Second)
	stopLoad()
	res := <-loaded
	failOn(t, res.errs)
	accepted := len(res.debits) + len(res.charges)
	s.waitCompleted(t, accepted, 3*time.Minute)
	done := time.Since(killed)
	s.checkEachOnce(t, res.debits, res.charges)
	republished := s.sum(t, "idemq_outbox_events_total", `event="republished"`)
	t.Logf("master %s SIGKILLed under load; %s promoted; Redis writable again after %s; %d debits and %d charges accepted, each took effect once, all completed %s after the kill; %v republished by the outbox",
		old, master, writable.Round(time.Millisecond), len(res.debits), len(res.charges), done.Round(time.Millisecond), republished)
}

// TestRedisClusterEndToEnd runs `idemq api` and two `idemq worker` processes on a
// three-node Redis Cluster (IDEMQ_REDIS_CLUSTER=true, REDIS_URL in go-redis's cluster
// form): debits and charges posted through the API each take effect once, and the
// dashboard's queue list answers.
func TestRedisClusterEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three Redis servers")
	}
	t.Parallel()
	takeStackSlot(t)
	c, err := localserver.StartCluster(3)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	ctx := testenv.Context(t, 3*time.Minute)
	s, base, api, _ := startHAStack(t, ctx, c.URL, true)

	loadCtx, stop := context.WithTimeout(ctx, 5*time.Second)
	defer stop()
	debits, charges, errs := haLoad(loadCtx, base, 40)
	failOn(t, errs)
	s.waitCompleted(t, len(debits)+len(charges), 2*time.Minute)
	s.checkEachOnce(t, debits, charges)
	req, _ := http.NewRequestWithContext(ctx, "GET", base+"/monitoring/api/queues", nil)
	req.SetBasicAuth("ops", "pw")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("the dashboard's queue list on a cluster: %d", resp.StatusCode)
	}
	// asynq writes its servers' state every 5 s, the reconciler probes every 2 s: nothing
	// of either may fail on a cluster (a script touching keys of several slots would).
	time.Sleep(6 * time.Second)
	for _, p := range append([]*proc{api}, s.workers...) {
		if log := p.tail(1 << 20); strings.Contains(log, "level=ERROR") || strings.Contains(log, "level=WARN") {
			t.Fatalf("%s logged warnings or errors on a cluster:\n%s", p.name, log)
		}
	}
	t.Logf("%d debits and %d charges through a 3-node cluster, each took effect once", len(debits), len(charges))
}
