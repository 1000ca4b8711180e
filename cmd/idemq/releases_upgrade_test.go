package main

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// debitLoad is what a load of debits sent: how many were accepted, how many of those were
// duplicated by a plain producer, and the refusals (answers other than 202 or 200, and
// failed publishes).
type debitLoad struct {
	accepted, dups int
	refused        []string
}

// loadDebits posts debits mig-0, mig-1, … to the api at base until ctx ends, each with an
// Idempotency-Key (a refused one again, with the same key, while ctx lasts), and
// publishes a duplicate of every fourth accepted straight to asynq; it returns what it
// sent once ctx has ended.
func (m *mixed) loadDebits(ctx context.Context, base string) debitLoad {
	var l debitLoad
	for i := 0; ctx.Err() == nil; i++ {
		d := tasks.Debit{AccountID: fmt.Sprintf("acct-%d", i%7), AmountCents: int64(10 + i), Reference: fmt.Sprintf("mig-%d", i)}
		spec, err := tasks.DebitSpec(d)
		if err != nil {
			l.refused = append(l.refused, err.Error())
			return l
		}
		for {
			// The test's context, not the load's: a request is answered even as the load stops.
			_, err = postOnce(m.ctx, http.DefaultClient, base+"/v1/wallet/debits", string(spec.Payload), "hk-"+d.Reference)
			if err == nil || ctx.Err() != nil {
				break
			}
			l.refused = append(l.refused, err.Error())
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil {
			l.refused = append(l.refused, err.Error())
			return l
		}
		l.accepted++
		if i%4 == 0 {
			if _, err := m.client.EnqueueContext(m.ctx, spec.Task(d.Key()+"#dup", time.Now(), asynq.Retention(time.Hour))); err != nil {
				l.refused = append(l.refused, "plain duplicate: "+err.Error())
			}
			l.dups++
		}
		time.Sleep(10 * time.Millisecond)
	}
	return l
}

// This commit's migrations are applied while the newest release serves: the release
// migrates its schema, its api and two workers take a stream of debits (through the api,
// and duplicates of some from a plain asynq producer), and this commit's migrate runs in
// the middle of it. The release's processes keep serving: every request is accepted at
// the first try, every debit takes effect once, nothing is archived, every intent ends
// done.
func TestReleaseServesThroughTheMigration(t *testing.T) {
	t.Parallel()
	m := startMixed(t, 2*time.Minute)
	m.runOld("migrate")
	port := testenv.FreePort(t)
	api := fmt.Sprintf("http://127.0.0.1:%d", port)
	procs := []*proc{startBinary(t, m.old, "api-"+m.r.Version,
		append(append([]string{}, m.env...), fmt.Sprintf("IDEMQ_HTTP_ADDR=127.0.0.1:%d", port), "IDEMQ_API_POOL_SIZE=8"), "api")}
	testenv.WaitHTTP(t, api+"/healthz", 30*time.Second)
	for range 2 {
		procs = append(procs, m.worker(true, "IDEMQ_CONCURRENCY=4"))
	}

	ctx, stopLoad := context.WithCancel(m.ctx)
	defer stopLoad()
	sent := make(chan debitLoad)
	go func() { sent <- m.loadDebits(ctx, api) }()
	time.Sleep(2 * time.Second)
	began := time.Now()
	if out := m.runNew("migrate"); !strings.Contains(out, "applied 00110_idemq_processes.sql") {
		t.Fatalf("this commit's migrate under load applied:\n%s", out)
	}
	took := time.Since(began)
	time.Sleep(3 * time.Second)
	stopLoad()
	l := <-sent
	for _, p := range procs {
		select {
		case <-p.done:
			t.Fatalf("%s exited during the migration", p.name)
		default:
		}
	}

	if len(l.refused) > 0 {
		t.Errorf("%d requests or publishes refused during the load, first: %s", len(l.refused), l.refused[0])
	}
	m.waitFor(fmt.Sprintf("%d debits completed", l.accepted), func() bool {
		return testenv.Count(t, m.pool, `SELECT count(*) FROM processed_jobs WHERE status = 'completed' AND idempotency_key LIKE 'debit:mig-%'`) == l.accepted
	})
	var q *asynq.QueueInfo
	m.waitFor("an idle queue", func() bool {
		var err error
		q, err = m.insp.GetQueueInfo(tasks.Queue)
		return err == nil && q.Pending+q.Active+q.Scheduled+q.Retry == 0
	})
	var entries, maxPer int
	m.pool.QueryRow(m.ctx, `SELECT count(*), coalesce(max(n), 0) FROM (SELECT count(*) n FROM wallet_entries GROUP BY reference) x`).Scan(&entries, &maxPer)
	t.Logf("%d debits (%d with a plain duplicate) over %s's api and workers; this commit's migrate took %s under it; %d tasks processed",
		l.accepted, l.dups, m.r.Version, took.Round(time.Millisecond), q.ProcessedTotal)
	if entries != l.accepted || maxPer != 1 {
		t.Errorf("wallet entries %d (max %d per reference), want %d, one per reference", entries, maxPer, l.accepted)
	}
	if q.Archived != 0 || q.FailedTotal != 0 {
		t.Errorf("asynq: %d archived, %d failed; want none", q.Archived, q.FailedTotal)
	}
	m.waitIntentsDone(l.accepted)
	if l.accepted < 50 {
		t.Errorf("only %d debits sent: the load did not run through the migration", l.accepted)
	}
}

// releaseReconcileEvery is how often the release's reconciler runs its round (not
// configurable in v0.1.0); each round first settles done every published intent whose
// key the ledger holds completed.
const releaseReconcileEvery = 30 * time.Second

// waitIntentsDone waits until all n intents are done, each with its first publish (no
// republish), and fails the test otherwise. The release's workers settle an intent in the
// transaction that completes its key, except in a shared transaction whose finish meets
// the intent's row still being marked published (docs/releases.md, "v0.1.0 settles
// intents by key"): those are settled by the release's reconciler at its next round. So
// an intent still open once the queue is idle must have its key completed in the ledger,
// and must be done within a round. Rather than wait up to 30 s for the round, the test
// removes the queue's epoch marker when an intent is open: the release's reconciler then
// runs its round at once (within its 2 s probe), without grace. Every task is still in
// Redis, so nothing is republished.
func (m *mixed) waitIntentsDone(n int) {
	m.t.Helper()
	open := testenv.Strings(m.t, m.pool, `SELECT i.idempotency_key || ' ' || i.state || ', ledger ' || coalesce(p.status, 'none')
		FROM job_intents i LEFT JOIN processed_jobs p USING (idempotency_key) WHERE i.state <> 'done' ORDER BY 1`)
	for _, o := range open {
		if !strings.HasSuffix(o, " published, ledger completed") {
			m.t.Errorf("intent %s once the queue is idle; want done, or published with its key completed", o)
		}
	}
	began := time.Now()
	if len(open) > 0 {
		m.loseQueue()
	}
	ctx, cancel := context.WithTimeout(m.ctx, releaseReconcileEvery+15*time.Second)
	defer cancel()
	waitUntil(m.t, ctx, fmt.Sprintf("%d intents done", n), func() bool {
		return testenv.Count(m.t, m.pool, `SELECT count(*) FROM job_intents WHERE state = 'done' AND publish_generation = 0`) == n
	})
	if len(open) > 0 {
		m.t.Logf("%d intents were still published with their keys completed once the queue was idle (%s); the release's reconciler settled them %s later (its round run at once)",
			len(open), strings.Join(open, "; "), time.Since(began).Round(100*time.Millisecond))
	}
	if got := testenv.Count(m.t, m.pool, `SELECT count(*) FROM job_intents`); got != n {
		m.t.Errorf("%d intents, want %d", got, n)
	}
}
