package metrics

import (
	"strings"
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
