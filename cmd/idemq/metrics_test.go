package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/handlers"
	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/config"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/lock"
	"github.com/idemq/idemq/tasks"
)

// gatedProvider is a payment provider that holds the charges of chosen keys until the
// test opens their gate (or the caller gives up).
type gatedProvider struct {
	mu      sync.Mutex
	gates   map[string]chan struct{}
	entered map[string]chan struct{}
}

func newGatedProvider(keys ...string) *gatedProvider {
	p := &gatedProvider{gates: map[string]chan struct{}{}, entered: map[string]chan struct{}{}}
	for _, k := range keys {
		p.gates[k], p.entered[k] = make(chan struct{}), make(chan struct{})
	}
	return p
}

func (p *gatedProvider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	if key == "" {
		key = r.Header.Get(handlers.HeaderKey) // a receipt
	}
	var c tasks.Charge
	json.NewDecoder(r.Body).Decode(&c)
	p.mu.Lock()
	gate, entered := p.gates[key], p.entered[key]
	if entered != nil {
		select {
		case <-entered:
		default:
			close(entered)
		}
	}
	p.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-r.Context().Done():
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	if r.URL.Path == "/v1/emails" { // a checkout's receipt
		fmt.Fprint(w, `{"id":1}`)
		return
	}
	fmt.Fprintf(w, `{"id":"ch_%s","amount_cents":%d,"currency":%q}`, c.OrderID, c.AmountCents, c.Currency)
}

func (p *gatedProvider) waitEntered(t *testing.T, key string) {
	t.Helper()
	select {
	case <-p.entered[key]:
	case <-time.After(60 * time.Second):
		t.Fatalf("the worker never called the provider for %s", key)
	}
}

func (p *gatedProvider) open(key string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.gates[key]:
	default:
		close(p.gates[key])
	}
}

// scrape reads one sample of the worker's /metrics: name{labels} with labels in the
// exposition's (alphabetical) order; 0 when absent.
func scrape(t *testing.T, url, series string) float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`).FindSubmatch(b)
	if m == nil {
		return 0
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// waitMetric waits until series satisfies ok, for up to a minute.
func waitMetric(t *testing.T, url, series string, ok func(float64) bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	var v float64
	for time.Now().Before(deadline) {
		if v = scrape(t, url, series); ok(v) {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	resp, err := http.Get(url)
	var idemq []string
	if err == nil {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "idemq_") && !strings.Contains(line, "_bucket{") || strings.HasPrefix(line, "asynq_tasks") && !strings.HasSuffix(line, " 0") {
				idemq = append(idemq, line)
			}
		}
	}
	t.Fatalf("%s stayed at %v for a minute; the worker's metrics:\n%s", series, v, strings.Join(idemq, "\n"))
}

func ledgerEvent(ev, typ string) string {
	return fmt.Sprintf(`idemq_ledger_events_total{event=%q,task_type=%q}`, ev, typ)
}

func lockEvent(ev, typ string) string {
	return fmt.Sprintf(`idemq_lock_events_total{event=%q,task_type=%q}`, ev, typ)
}

func handled(typ, outcome string) string {
	return fmt.Sprintf(`idemq_handler_duration_seconds_count{outcome=%q,task_type=%q}`, outcome, typ)
}

// TestWorkerMetrics runs a worker in process and drives each ledger and lock outcome
// once, and a checkout's steps, then checks the counters and the handler histograms on
// its /metrics.
func TestWorkerMetrics(t *testing.T) {
	t.Parallel()
	dsn, rurl := testenv.PostgresURL(t), testenv.RedisURL(t)
	provider := newGatedProvider("charge:o-lease", "charge:o-lock")
	fake := httptest.NewServer(provider)
	t.Cleanup(fake.Close)
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	cfg := &config.Worker{
		Redis: config.Redis{RedisURL: rurl}, Database: config.Database{DatabaseURL: dsn},
		Concurrency: 4, Queues: []string{"default"}, Lease: 3 * time.Second, LockTTL: 3 * time.Second,
		ShutdownTimeout: 5 * time.Second, MetricsAddr: addr, FakepayURL: fake.URL,
		Retention: 720 * time.Hour, MaxAge: 24 * time.Hour, LogLevel: "warn", GroupCommit: true,
	}
	metricsURL := startWorker(t, cfg, func() {
		provider.open("charge:o-lease")
		provider.open("charge:o-lock")
	})

	client := asynq.NewClient(asynq.RedisClientOpt{Addr: mustRedisAddr(t, rurl), DB: mustRedisDB(t, rurl)})
	t.Cleanup(func() { client.Close() })
	rdb := testenv.RedisClient(t, rurl)
	pool := testenv.Pool(t, dsn)
	ledger := idempotency.New(pool, &idempotency.Config{Lease: 4 * time.Second})
	t.Cleanup(ledger.Close)
	tctx := testenv.Context(t, 3*time.Minute)
	enqueue := func(spec outbox.Spec, taskID string) {
		t.Helper()
		if _, err := client.EnqueueContext(tctx, spec.Task(taskID, time.Now())); err != nil {
			t.Fatalf("enqueue %s: %v", taskID, err)
		}
	}
	debit := func(account, ref string) outbox.Spec {
		s, err := tasks.DebitSpec(tasks.Debit{AccountID: account, AmountCents: 100, Reference: ref})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	charge := func(order, customer string) outbox.Spec {
		s, err := tasks.ChargeSpec(tasks.Charge{OrderID: order, CustomerID: customer, AmountCents: 1999, Currency: "EUR"})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	const D, C = tasks.TypeDebit, tasks.TypeCharge
	atLeast := func(n float64) func(float64) bool { return func(v float64) bool { return v >= n } }

	// claimed, then cache_hit for a second delivery of the same job under another TaskID,
	// then mismatch for the same key with another payload.
	r1 := debit("a-1", "r-1")
	enqueue(r1, r1.Key)
	waitMetric(t, metricsURL, handled(D, asynqmw.OutcomeCompleted), atLeast(1))
	enqueue(r1, r1.Key+"#dup")
	waitMetric(t, metricsURL, ledgerEvent("cache_hit", D), atLeast(1))
	enqueue(debit("a-other", "r-1"), r1.Key+"#mismatch")
	waitMetric(t, metricsURL, ledgerEvent("mismatch", D), atLeast(1))

	// busy: the test holds debit:r-2's lease (4 s, no heartbeat); the worker's delivery
	// is busy, and the retry after the lease ends takes it over.
	r2 := debit("a-2", "r-2")
	if _, err := ledger.Claim(tctx, idempotency.Request{Key: r2.Key, TaskType: D, Fingerprint: idempotency.Fingerprint(D, r2.Payload)}); err != nil {
		t.Fatal(err)
	}
	enqueue(r2, r2.Key)
	waitMetric(t, metricsURL, ledgerEvent("busy", D), atLeast(1))
	waitMetric(t, metricsURL, ledgerEvent("takeover", D), atLeast(1))
	waitMetric(t, metricsURL, handled(D, asynqmw.OutcomeCompleted), atLeast(2))

	// lock busy: the test holds the Redis lock of debit:r-3's scope; released, the job
	// runs.
	locker := lock.New(rdb, nil)
	held, err := locker.Obtain(tctx, "account:a-3", time.Minute, nil)
	if err != nil {
		t.Fatal(err)
	}
	r3 := debit("a-3", "r-3")
	enqueue(r3, r3.Key)
	waitMetric(t, metricsURL, lockEvent("busy", D), atLeast(1))
	if err := held.Release(tctx); err != nil {
		t.Fatal(err)
	}
	waitMetric(t, metricsURL, handled(D, asynqmw.OutcomeCompleted), atLeast(3))

	// lease_lost: while the charge waits on the provider, the test ends its lease and
	// takes the key over; the worker's next heartbeat finds the fence gone.
	leaseJob := charge("o-lease", "c-lease")
	enqueue(leaseJob, leaseJob.Key)
	provider.waitEntered(t, leaseJob.Key)
	if err := ledger.Release(tctx, leaseJob.Key); err != nil {
		t.Fatal(err)
	}
	if _, err := ledger.Claim(tctx, idempotency.Request{Key: leaseJob.Key, TaskType: C, Fingerprint: idempotency.Fingerprint(C, leaseJob.Payload)}); err != nil {
		t.Fatal(err)
	}
	waitMetric(t, metricsURL, ledgerEvent("lease_lost", C), atLeast(1))

	// lock lost: while a charge waits on the provider, its lock (scope customer:c-lock)
	// disappears from Redis; the watchdog's next refresh notices.
	lockJob := charge("o-lock", "c-lock")
	enqueue(lockJob, lockJob.Key)
	provider.waitEntered(t, lockJob.Key)
	if err := rdb.Del(tctx, lock.DefaultPrefix+"customer:c-lock").Err(); err != nil {
		t.Fatal(err)
	}
	waitMetric(t, metricsURL, lockEvent("lost", C), atLeast(1))

	// A checkout runs and records its three steps, once each.
	co, err := tasks.CheckoutSpec(tasks.Checkout{OrderID: "o-steps", CustomerID: "c-steps", AmountCents: 1999, Currency: "EUR", Email: "buyer@example.com"})
	if err != nil {
		t.Fatal(err)
	}
	enqueue(co, co.Key)
	waitMetric(t, metricsURL, handled(tasks.TypeCheckout, asynqmw.OutcomeCompleted), atLeast(1))
	for _, step := range tasks.CheckoutSteps {
		series := fmt.Sprintf(`idemq_steps_total{outcome="ran",step=%q,task_type=%q}`, step, tasks.TypeCheckout)
		if v := scrape(t, metricsURL, series); v != 1 {
			t.Errorf("%s = %v, want 1", series, v)
		}
	}

	// The values, now that every outcome happened.
	for _, tc := range []struct {
		series string
		want   func(float64) bool
		desc   string
	}{
		{ledgerEvent("claimed", D), eq(2), "r-1 and r-3 claimed fresh (r-2 was taken over)"},
		{ledgerEvent("takeover", D), eq(1), "r-2 after the test's lease ended"},
		{ledgerEvent("cache_hit", D), eq(1), "the second delivery of r-1"},
		{ledgerEvent("mismatch", D), eq(1), "r-1 with another account, archived at once"},
		{ledgerEvent("busy", D), atLeast(1), "r-2 while the test held it"},
		{ledgerEvent("completed", D), eq(3), "r-1, r-2, r-3"},
		{ledgerEvent("claimed", C), eq(2), "o-lease and o-lock"},
		{ledgerEvent("lease_lost", C), atLeast(1), "o-lease after the test took it over"},
		{lockEvent("obtained", D), atLeast(5), "r-1, its duplicate, the mismatch, r-2 (twice or more), r-3"},
		{lockEvent("busy", D), atLeast(1), "r-3 while the test held account:a-3"},
		{lockEvent("lost", C), atLeast(1), "o-lock after its key vanished"},
		{lockEvent("obtained", C), atLeast(2), "o-lease and o-lock"},
		{handled(D, asynqmw.OutcomeCompleted), eq(3), "r-1, r-2, r-3"},
		{handled(D, asynqmw.OutcomeCached), eq(1), "the duplicate of r-1"},
		{handled(D, asynqmw.OutcomeRejected), eq(1), "the mismatch"},
		{handled(D, asynqmw.OutcomeBusy), atLeast(2), "ledger busy (r-2) and lock busy (r-3)"},
		{handled(C, asynqmw.OutcomeError), atLeast(1), "o-lease, cancelled by its lost lease"},
	} {
		if v := scrape(t, metricsURL, tc.series); !tc.want(v) {
			t.Errorf("%s = %v: want %s", tc.series, v, tc.desc)
		}
	}
	if v := scrape(t, metricsURL, `idemq_handler_duration_seconds_sum{outcome="completed",task_type="wallet:debit"}`); v <= 0 {
		t.Errorf("handler duration sum %v, want > 0", v)
	}
	for _, kind := range []string{idempotency.BatchClaim, idempotency.BatchComplete, idempotency.BatchTx} {
		if v := scrape(t, metricsURL, fmt.Sprintf(`idemq_ledger_commit_requests_count{kind=%q}`, kind)); v < 1 {
			t.Errorf("%s commits observed: %v, want some", kind, v)
		}
	}
}

// startWorker runs `idemq worker` with cfg in this process until the test ends (first
// calling beforeStop, when set, so that nothing it holds keeps the worker from stopping),
// and returns its /metrics URL once it is ready.
func startWorker(t *testing.T, cfg *config.Worker, beforeStop func()) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- runWorker(ctx, cfg, slog.New(slog.NewTextHandler(tLogWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})))
	}()
	t.Cleanup(func() {
		if beforeStop != nil {
			beforeStop()
		}
		cancel()
		if err := <-done; err != nil {
			t.Errorf("worker: %v", err)
		}
	})
	waitReady(t, func() bool {
		r, err := http.Get("http://" + cfg.MetricsAddr + "/readyz")
		return err == nil && r.Body.Close() == nil && r.StatusCode == 200
	})
	return "http://" + cfg.MetricsAddr + "/metrics"
}

func eq(n float64) func(float64) bool { return func(v float64) bool { return v == n } }

type tLogWriter struct{ t *testing.T }

func (w tLogWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}

func waitReady(t *testing.T, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if ok() {
			return
		}
	}
	t.Fatal("the worker's /readyz never answered 200")
}

func mustRedisAddr(t *testing.T, url string) string {
	opt, err := asynq.ParseRedisURI(url)
	if err != nil {
		t.Fatal(err)
	}
	return opt.(asynq.RedisClientOpt).Addr
}

func mustRedisDB(t *testing.T, url string) int {
	opt, err := asynq.ParseRedisURI(url)
	if err != nil {
		t.Fatal(err)
	}
	return opt.(asynq.RedisClientOpt).DB
}

// TestWorkerWithoutGroupCommit: with IDEMQ_GROUP_COMMIT=false every debit completes
// exactly once in a transaction of its own: no shared commit is observed.
func TestWorkerWithoutGroupCommit(t *testing.T) {
	t.Parallel()
	cfg := debitWorker(t)
	cfg.GroupCommit = false
	metricsURL, pool, n := drainDebitsTwice(t, cfg, "gc")
	// The retention round the worker runs at its start sent its two purge statements
	// (the ledger's, the dead intents'), each observed.
	waitMetric(t, metricsURL, "idemq_purge_seconds_count", func(v float64) bool { return v >= 2 })
	// That round caught up: nothing left to purge, exported by the replica that ran it.
	if resp, err := http.Get(metricsURL); err != nil {
		t.Error(err)
	} else {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !regexp.MustCompile(`(?m)^idemq_purge_backlog_rows 0$`).Match(b) {
			t.Errorf("no idemq_purge_backlog_rows 0 after a round that caught up")
		}
	}
	if v := scrape(t, metricsURL, `idemq_ledger_commit_requests_count{kind="tx"}`); v != 0 {
		t.Errorf("%v shared transactions observed with group commit off, want 0", v)
	}
	var entries, refs int
	if err := pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT reference) FROM wallet_entries WHERE reference LIKE 'gc-%'`).Scan(&entries, &refs); err != nil {
		t.Fatal(err)
	}
	if entries != n || refs != n {
		t.Errorf("%d wallet entries over %d references, want %d each: one per debit", entries, refs, n)
	}
}

// TestWorkerDebitsThroughSQL: with IDEMQ_DEBIT_DRIVER=sql the worker's debits run through
// database/sql (server.HandleSQLTx): every debit and its duplicate complete once, one
// entry each, fenced like the pgx handler's; a bad value stops the worker naming it.
func TestWorkerDebitsThroughSQL(t *testing.T) {
	t.Parallel()
	cfg := debitWorker(t)
	bad := *cfg
	bad.DebitDriver = "mysql"
	if err := runWorker(testenv.Context(t, time.Minute), &bad, slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), "IDEMQ_DEBIT_DRIVER") {
		t.Fatalf("IDEMQ_DEBIT_DRIVER=mysql: %v, want a refusal naming it", err)
	}
	cfg.DebitDriver = "sql"
	_, pool, n := drainDebitsTwice(t, cfg, "sql")
	var entries, refs, fenced int
	if err := pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT e.reference), count(*) FILTER (WHERE e.fence = p.fence)
		FROM wallet_entries e JOIN processed_jobs p ON p.idempotency_key = 'debit:' || e.reference
		WHERE e.reference LIKE 'sql-%'`).Scan(&entries, &refs, &fenced); err != nil {
		t.Fatal(err)
	}
	if entries != n || refs != n || fenced != n {
		t.Errorf("%d wallet entries over %d references, %d with the completion's fence; want %d each", entries, refs, fenced, n)
	}
}

// debitWorker is a worker's configuration on the test's own schema and Redis database.
func debitWorker(t *testing.T) *config.Worker {
	dsn, rurl := testenv.PostgresURL(t), testenv.RedisURL(t)
	return &config.Worker{
		Redis: config.Redis{RedisURL: rurl}, Database: config.Database{DatabaseURL: dsn},
		Concurrency: 8, Queues: []string{"default"}, Lease: 5 * time.Second, LockTTL: 5 * time.Second,
		ShutdownTimeout: 5 * time.Second, MetricsAddr: fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t)), FakepayURL: "http://127.0.0.1:1",
		Retention: 720 * time.Hour, MaxAge: 24 * time.Hour, LogLevel: "warn", GroupCommit: true,
	}
}

// drainDebitsTwice starts a worker with cfg, enqueues n debits over 4 accounts, each
// twice under TaskIDs of its own (references prefix-0 …), waits until every one was
// answered, and checks that each completed once. It returns the worker's metrics URL,
// a pool on its schema and n.
func drainDebitsTwice(t *testing.T, cfg *config.Worker, prefix string) (metricsURL string, pool *pgxpool.Pool, n int) {
	t.Helper()
	metricsURL = startWorker(t, cfg, nil)
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: mustRedisAddr(t, cfg.RedisURL), DB: mustRedisDB(t, cfg.RedisURL)})
	t.Cleanup(func() { client.Close() })
	tctx := testenv.Context(t, 3*time.Minute)
	n = 40
	for i := range n {
		s, err := tasks.DebitSpec(tasks.Debit{AccountID: fmt.Sprintf("%s-%d", prefix, i%4), AmountCents: 100, Reference: fmt.Sprintf("%s-%d", prefix, i)})
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range []string{s.Key, s.Key + "#dup"} {
			if _, err := client.EnqueueContext(tctx, s.Task(id, time.Now())); err != nil {
				t.Fatalf("enqueue %s: %v", id, err)
			}
		}
	}
	waitMetric(t, metricsURL, handled(tasks.TypeDebit, asynqmw.OutcomeCompleted), func(v float64) bool { return v >= float64(n) })
	waitMetric(t, metricsURL, handled(tasks.TypeDebit, asynqmw.OutcomeCached), func(v float64) bool { return v >= float64(n) })
	if v := scrape(t, metricsURL, handled(tasks.TypeDebit, asynqmw.OutcomeCompleted)); v != float64(n) {
		t.Errorf("%v debits completed, want %d: each once", v, n)
	}
	return metricsURL, testenv.Pool(t, cfg.DatabaseURL), n
}
