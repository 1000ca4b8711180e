package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/localserver"
	"github.com/idemq/idemq/internal/testenv"
)

// TestPostgresFailoverSynchronousStandby promotes a synchronous standby under load:
// every job the API accepted takes effect exactly once.
func TestPostgresFailoverSynchronousStandby(t *testing.T) { testPostgresFailover(t, true) }

// TestPostgresFailoverAsynchronousStandby promotes an asynchronous standby under load and
// reports what its lost window did: no effect happens twice, but a job accepted in the
// window may be gone.
func TestPostgresFailoverAsynchronousStandby(t *testing.T) { testPostgresFailover(t, false) }

// failoverLag is how long the standby receives nothing before the primary dies: the
// window an asynchronous standby loses.
const failoverLag = time.Second

// testPostgresFailover runs `idemq api` and two workers on a primary and a streaming
// standby named together in DATABASE_URL (host=a,b, target_session_attrs=read-write),
// posts debits and charges through the API, stops the primary's WAL sender for
// failoverLag, SIGKILLs the primary and promotes the standby. fakepay keeps its charges in
// another database, as a real provider would. It logs the recovery times and what became
// of every accepted job.
func testPostgresFailover(t *testing.T, synchronous bool) {
	if testing.Short() {
		t.Skip("starts two Postgres servers")
	}
	t.Parallel()
	takeStackSlot(t)
	primary, standby := testenv.StartPair(t, synchronous)
	url := localserver.MultiHostURL(primary, standby)
	if _, stderr, err := idemq(t, []string{"DATABASE_URL=" + url}, "migrate"); err != nil {
		t.Fatalf("migrate: %v\n%s", err, stderr)
	}

	ctx := testenv.Context(t, 6*time.Minute)
	redisURL := testenv.RedisURL(t)
	fakepayDSN := testenv.PostgresURL(t)
	s := startStackDB(t, 2, redisURL, testenv.RedisClient(t, redisURL), url, fakepayDSN, nil, []string{"IDEMQ_RECONCILE_GRACE=10s"})
	provider := testenv.Pool(t, fakepayDSN)
	port := testenv.FreePort(t)
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	startIdemq(t, "api", []string{"DATABASE_URL=" + url, "REDIS_URL=" + redisURL, fmt.Sprintf("IDEMQ_HTTP_ADDR=127.0.0.1:%d", port),
		"IDEMQ_LOG_LEVEL=warn"}, "api")
	testenv.WaitHTTP(t, base+"/readyz", 30*time.Second)

	loadCtx, stopLoad := context.WithCancel(ctx)
	loaded := make(chan haResult, 1)
	go func() { loaded <- haLoadRefusing(loadCtx, base, 40) }()

	time.Sleep(3 * time.Second)
	if err := primary.HoldWAL(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(failoverLag)
	killed := time.Now()
	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := standby.Promote(); err != nil {
		t.Fatal(err)
	}
	promoted := time.Since(killed)
	writable, err := localserver.WaitWritable(ctx, url, killed, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Second)
	stopLoad()
	res := <-loaded
	failOn(t, res.errs)

	// Settled: every intent the new primary holds is done (a lost completion whose
	// intent survived is republished after IDEMQ_RECONCILE_GRACE).
	var open int
	for deadline := time.Now().Add(3 * time.Minute); ; time.Sleep(500 * time.Millisecond) {
		open = testenv.Count(t, s.pool, `SELECT count(*) FROM job_intents WHERE state <> 'done'`)
		if open == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d intents not done 3 minutes after the failover", open)
		}
	}
	settled := time.Since(killed)

	// What became of each accepted job: its intent on the new primary, and its effect (a
	// debit's wallet entry commits with its completion; a charge is a row at the provider,
	// which dedups by the key).
	f := failoverFigures{refused: len(res.refused), republished: s.sum(t, "idemq_outbox_events_total", `event="republished"`)}
	jobs := map[string]*jobFate{}
	for _, r := range res.debits {
		jobs["debit:"+r] = &jobFate{}
	}
	for _, r := range res.charges {
		jobs["charge:"+r] = &jobFate{}
	}
	f.accepted = len(jobs)
	for _, k := range testenv.Strings(t, s.pool, `SELECT idempotency_key FROM job_intents`) {
		if j := jobs[k]; j != nil {
			j.intent = true
		}
	}
	for _, k := range testenv.Strings(t, s.pool, `SELECT 'debit:' || reference FROM wallet_entries`) {
		if j := jobs[k]; j != nil {
			j.effects++
		}
	}
	for _, k := range testenv.Strings(t, provider, `SELECT 'charge:' || order_id FROM fakepay_charges`) {
		if j := jobs[k]; j != nil {
			j.effects++
		}
	}
	for k, j := range jobs {
		switch {
		case j.effects > 1:
			f.twice = append(f.twice, k)
		case j.intent && j.effects == 1:
			f.once++
		case j.intent:
			f.noEffect = append(f.noEffect, k)
		case j.effects == 1:
			f.lostIntentRan = append(f.lostIntentRan, k)
		default:
			f.gone = append(f.gone, k)
		}
	}
	// The workers are back when the first job completes after the kill.
	var back time.Time
	if err := s.pool.QueryRow(ctx, `SELECT min(completed_at) FROM processed_jobs WHERE completed_at > $1`, killed).Scan(&back); err != nil {
		t.Fatal(err)
	}
	mode := "asynchronous"
	if synchronous {
		mode = "synchronous"
	}
	t.Logf("%s standby: WAL held back %s, primary SIGKILLed, standby promoted in %s, writable through the multi-host URL %s after the kill, "+
		"first completion %s after it, every intent settled %s after it; %s",
		mode, failoverLag, promoted.Round(time.Millisecond), writable.Round(time.Millisecond), back.Sub(killed).Round(time.Millisecond),
		settled.Round(time.Second), f)
	if len(f.twice) > 0 || len(f.noEffect) > 0 {
		t.Fatalf("an effect happened twice or a recorded job never ran: %s", f)
	}
	if synchronous && f.once != f.accepted {
		t.Fatalf("with a synchronous standby every accepted job must take effect once: %s", f)
	}
}

// jobFate is what became of one accepted job.
type jobFate struct {
	intent  bool // its intent is on the new primary
	effects int  // wallet entries or provider charges
}

// failoverFigures counts the fates of the jobs accepted around a failover.
type failoverFigures struct {
	accepted, refused, once              int
	twice, noEffect, lostIntentRan, gone []string
	republished                          float64
}

func (f failoverFigures) String() string {
	return fmt.Sprintf("%d requests answered 503 (not accepted); %d jobs accepted (202): %d took effect once with their intent kept, "+
		"%d lost their intent but ran once (already in Redis) %v, %d lost their intent and never took effect %v, %d took effect twice %v, "+
		"%d kept their intent but never ran %v; %v republished by the reconciler",
		f.refused, f.accepted, f.once, len(f.lostIntentRan), f.lostIntentRan, len(f.gone), f.gone, len(f.twice), f.twice,
		len(f.noEffect), f.noEffect, f.republished)
}

// keys prefixes each of refs.
func keys(prefix string, refs []string) []string {
	out := make([]string, len(refs))
	for i, r := range refs {
		out[i] = prefix + r
	}
	return out
}
