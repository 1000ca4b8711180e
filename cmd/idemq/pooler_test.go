package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/localserver"
	"github.com/idemq/idemq/internal/testenv"
)

// TestBehindPgBouncer runs idemq behind a real PgBouncer in transaction mode whose pool
// (2 server connections) the load saturates:
//   - `idemq migrate` through the pooler refuses, naming IDEMQ_DIRECT_DATABASE_URL; with it
//     set, migrate runs against Postgres itself;
//   - `idemq api` and two workers with DATABASE_URL on the pooler (no exec mode in the URL:
//     they find the pooler and send unnamed statements) and IDEMQ_DIRECT_DATABASE_URL on
//     Postgres, plus a third worker without the direct URL: debits and charges (slowed by
//     the provider, so their 5 s leases live on heartbeats) each take effect once, while
//     clients queue at the pooler and while two clients hold both of its server
//     connections for 2 s;
//   - only the three processes with a direct URL LISTEN, on Postgres itself; the third
//     worker says why it does not.
func TestBehindPgBouncer(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Postgres and PgBouncer")
	}
	testenv.NeedBinary(t, "pgbouncer", "apt-get install -y pgbouncer")
	t.Parallel()
	takeStackSlot(t)
	pg, err := localserver.StartPostgres()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pg.Close() })
	pgb, err := localserver.StartPgBouncer(pg.URL, "transaction", 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pgb.Close() })

	_, stderr, err := idemq(t, []string{"DATABASE_URL=" + pgb.URL}, "migrate")
	if err == nil || !strings.Contains(stderr, "transaction-mode pooler") || !strings.Contains(stderr, "IDEMQ_DIRECT_DATABASE_URL") {
		t.Fatalf("migrate through the pooler: %v\n%s\nwant a refusal naming IDEMQ_DIRECT_DATABASE_URL", err, stderr)
	}
	direct := []string{"DATABASE_URL=" + pgb.URL, "IDEMQ_DIRECT_DATABASE_URL=" + pg.URL}
	if _, stderr, err := idemq(t, direct, "migrate"); err != nil {
		t.Fatalf("migrate with IDEMQ_DIRECT_DATABASE_URL: %v\n%s", err, stderr)
	}

	ctx := testenv.Context(t, 4*time.Minute)
	redisURL := testenv.RedisURL(t)
	s := startStackDB(t, 2, redisURL, testenv.RedisClient(t, redisURL), pg.URL, pg.URL,
		[]string{"IDEMQ_FAKEPAY_DELAY=1s"}, append(direct, "IDEMQ_LEASE=5s"))
	s.workerEnv = append(s.workerEnv, "IDEMQ_DIRECT_DATABASE_URL=")
	pooledOnly := s.startWorker(t, 2)
	port := testenv.FreePort(t)
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	api := startIdemq(t, "api", append([]string{"REDIS_URL=" + redisURL, fmt.Sprintf("IDEMQ_HTTP_ADDR=127.0.0.1:%d", port)}, direct...), "api")
	testenv.WaitHTTP(t, base+"/readyz", 30*time.Second)

	// Load, and watch the pooler's queue meanwhile.
	loadCtx, stop := context.WithTimeout(ctx, 6*time.Second)
	defer stop()
	var mu sync.Mutex
	var maxWaiting, maxServers int
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for loadCtx.Err() == nil {
			if st, err := pgb.Pool(ctx, "postgres"); err == nil {
				mu.Lock()
				maxWaiting, maxServers = max(maxWaiting, st.ClientWaiting), max(maxServers, st.ServerActive+st.ServerIdle)
				mu.Unlock()
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	// Two seconds in, two clients take both server connections for 2 s: what goes through
	// the pooler waits, heartbeats on the direct URL do not.
	held := make(chan error, 2)
	time.AfterFunc(2*time.Second, func() {
		for range 2 {
			go func() { held <- holdServerConnection(ctx, pgb.URL, 2*time.Second) }()
		}
	})
	debits, charges, errs := haLoad(loadCtx, base, 60)
	<-watched
	for range 2 {
		if err := <-held; err != nil {
			t.Fatalf("hold a server connection: %v", err)
		}
	}
	failOn(t, errs)
	s.waitCompleted(t, len(debits)+len(charges), 2*time.Minute)
	s.checkEachOnce(t, debits, charges)
	// A claim that waited at the stalled pooler for most of its lease may self-fence (the
	// worker cannot know when the lease began) and run again: counted, not a failure.
	fenced := s.sum(t, "idemq_ledger_events_total", `event="self_fenced"`) + s.sum(t, "idemq_ledger_events_total", `event="lease_lost"`)
	if maxWaiting == 0 {
		t.Errorf("no client ever waited at the pooler (at most %d server connections): the pool was not saturated", maxServers)
	}
	if maxServers > 2 {
		t.Errorf("the pooler held %d server connections, above its pool of 2", maxServers)
	}
	listening := testenv.Count(t, s.pool, `SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN idemq_outbox'`)
	if listening != 3 {
		t.Errorf("%d sessions LISTEN on Postgres; want 3 (the API and the two workers with a direct URL)", listening)
	}
	if log := pooledOnly.tail(1 << 20); !strings.Contains(log, "not listening for wake-ups") {
		t.Errorf("the worker without a direct URL did not say it polls:\n%s", log)
	}
	if log := api.tail(1 << 20); strings.Contains(log, "level=ERROR") {
		t.Errorf("the API logged errors behind the pooler:\n%s", log)
	}
	for _, p := range append([]*proc{api}, s.workers...) {
		if log := p.tail(1 << 20); strings.Contains(log, "prepared statement") {
			t.Errorf("%s met prepared statements behind the pooler:\n%s", p.name, log)
		}
	}
	t.Logf("%d debits and %d charges through PgBouncer (transaction mode, 2 server connections, both held for 2 s, up to %d clients waiting), each took effect once; "+
		"%v deliveries self-fenced and ran again", len(debits), len(charges), maxWaiting, fenced)
}

// holdServerConnection takes a server connection of the pooler at url in a transaction
// and keeps it for d.
func holdServerConnection(ctx context.Context, url string, d time.Duration) error {
	conn, err := pgx.Connect(ctx, url+"&default_query_exec_mode=simple_protocol")
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
		return err
	}
	time.Sleep(d)
	return tx.Commit(ctx)
}
