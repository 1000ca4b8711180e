package metrics

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// The needs-attention gauge counts the rows an operator must look at, and reads the
// table again only once its interval has passed.
func TestLedgerCollectorCountsNeedsAttention(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ledger := idempotency.New(pool, nil)
	t.Cleanup(ledger.Close)
	c := NewLedgerCollector(ledger, time.Second)
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	gauge := func() float64 {
		t.Helper()
		families, err := reg.Gather()
		if err != nil || len(families) != 1 || len(families[0].GetMetric()) != 1 {
			t.Fatalf("gathered %v (%v), want one series", families, err)
		}
		return families[0].GetMetric()[0].GetGauge().GetValue()
	}
	ins := `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, locked_until, started_at)
		VALUES ($1, 't', $2, nextval('processed_jobs_fence_seq'), gen_random_uuid(), now(), now())`
	testenv.Exec(t, pool, ins, "busy-1", "in_progress")
	if got := gauge(); got != 0 {
		t.Fatalf("gauge with no stuck row = %v, want 0", got)
	}
	testenv.Exec(t, pool, ins, "stuck-1", "needs_attention")
	testenv.Exec(t, pool, ins, "stuck-2", "needs_attention")
	if got := gauge(); got != 0 {
		t.Fatalf("gauge read again within its interval = %v, want the cached 0", got)
	}
	time.Sleep(1100 * time.Millisecond)
	if got := gauge(); got != 2 {
		t.Fatalf("gauge = %v, want 2", got)
	}
	if _, err := ledger.CountStatus(testenv.Context(t, time.Second), "stuck"); err == nil || !strings.Contains(err.Error(), `"stuck"`) {
		t.Errorf("Count of an unknown status: %v, want an error naming it", err)
	}
}

// The purge backlog gauge shows what the last retention round of this process left
// behind, and disappears once this process has run no round for three intervals: another
// replica's rounds know the backlog now.
func TestPurgeBacklogGaugeGoesStale(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	m := New()
	ledger := idempotency.New(pool, &idempotency.Config{ObservePurgeBacklog: m.ObservePurgeBacklog})
	t.Cleanup(ledger.Close)
	ctx := testenv.Context(t, 30*time.Second)
	testenv.Exec(t, pool, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, started_at, completed_at)
		SELECT 'old-' || i, 't', 'completed', nextval('processed_jobs_fence_seq'), now() - interval '3 days', now() - interval '2 days'
		FROM generate_series(1, 3) i`)
	testenv.Exec(t, pool, `ANALYZE processed_jobs`)
	gauge := func() (float64, bool) {
		t.Helper()
		families, err := m.Registry.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range families {
			if f.GetName() == "idemq_purge_backlog_rows" {
				return f.GetMetric()[0].GetGauge().GetValue(), true
			}
		}
		return 0, false
	}
	if v, ok := gauge(); ok {
		t.Fatalf("gauge before any round = %v, want no series", v)
	}
	var rounds atomic.Int64
	run, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		// One round of one batch (its budget is over at once), then no turn again.
		ledger.RunRetention(run, idempotency.RetentionConfig{OlderThan: 24 * time.Hour, Every: 200 * time.Millisecond,
			Budget: time.Nanosecond, Batch: 1, Turn: func(context.Context) bool { return rounds.Add(1) == 1 }})
	}()
	defer func() { stop(); <-done }()
	v, ok := gauge()
	for ; !ok && ctx.Err() == nil; v, ok = gauge() {
		time.Sleep(10 * time.Millisecond)
	}
	if v != 2 {
		t.Fatalf("gauge after a round that purged one of three rows = %v, want 2", v)
	}
	for ; ok && ctx.Err() == nil; _, ok = gauge() {
		time.Sleep(20 * time.Millisecond)
	}
	if ok {
		t.Fatal("the gauge of a process that runs no more rounds never went away")
	}
	if rounds.Load() < 4 {
		t.Errorf("the turn was asked %d times before the gauge went away, want a round's and several refused", rounds.Load())
	}
}
