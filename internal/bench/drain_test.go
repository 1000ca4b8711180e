package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
)

// The Zipf workload is skewed as Zipf(1.1) over 1,000 scopes is: the hottest scope takes
// 1/H(1000, 1.1) ≈ 18 % of the tasks, and most scopes are rare.
func TestZipfScopesAreSkewed(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	draw := zipf(1000)
	counts := map[int]int{}
	for i := range 20000 {
		counts[draw(rng, i)]++
	}
	if top := counts[0]; top < 3100 || top > 4100 {
		t.Errorf("scope 0 drew %d of 20000, want about 3,600 (Zipf 1.1 over 1,000)", top)
	}
	if len(counts) < 400 || len(counts) > 1000 {
		t.Errorf("%d distinct scopes drawn, want several hundred of 1,000", len(counts))
	}
}

// The table pairs each worker sample with bare asynq's of the same repetition.
func TestDrainTablePairsByRepetition(t *testing.T) {
	var b bytes.Buffer
	err := WriteDrainTable(&b, []DrainSample{
		{Workload: "debit-distinct", Concurrency: 10, Config: DrainBare, Rep: 1, Deliveries: 100, PerSecond: 1000},
		{Workload: "debit-distinct", Concurrency: 10, Config: DrainBare, Rep: 2, Deliveries: 100, PerSecond: 2000},
		{Workload: "debit-distinct", Concurrency: 10, Config: "worker×1", Rep: 1, Deliveries: 100, PerSecond: 500},
		{Workload: "debit-distinct", Concurrency: 10, Config: "worker×1", Rep: 2, Deliveries: 100, PerSecond: 500},
	})
	if err != nil {
		t.Fatal(err)
	}
	// Per repetition 0.50 and 0.25: the paired median is 0.38 (0.375), not 500/1500.
	if !strings.Contains(b.String(), "**0.38** (0.25–0.50)") {
		t.Errorf("table:\n%s\nwant the worker's paired ratio 0.38 (0.25–0.50)", b.String())
	}
	if i, j := strings.Index(b.String(), "| bare |"), strings.Index(b.String(), "| worker×1 |"); i < 0 || j < i {
		t.Errorf("bare asynq's row must come first:\n%s", b.String())
	}
}

// The drain reads the workers' counters and the commit-size histogram from their metrics
// page, summed over task types.
func TestDrainReadsWorkerMetrics(t *testing.T) {
	page := `# TYPE idemq_lock_events_total counter
idemq_lock_events_total{event="busy",task_type="a"} 2
idemq_lock_events_total{event="busy",task_type="b"} 3
idemq_lock_events_total{event="handed",task_type="a"} 7
# TYPE idemq_ledger_commit_requests histogram
idemq_ledger_commit_requests_bucket{kind="tx",le="+Inf"} 4
idemq_ledger_commit_requests_sum{kind="tx"} 10
idemq_ledger_commit_requests_count{kind="tx"} 4
idemq_ledger_commit_requests_bucket{kind="claim",le="+Inf"} 1
idemq_ledger_commit_requests_sum{kind="claim"} 2
idemq_ledger_commit_requests_count{kind="claim"} 1
`
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, page) }))
	defer srv.Close()
	m := scrape(context.Background(), srv.URL)
	if busy := events(m, "idemq_lock_events_total", "busy"); busy != 5 {
		t.Errorf("busy %v, want 5", busy)
	}
	if n := events(m, "idemq_lock_events_total", "busy", "handed"); n != 12 {
		t.Errorf("busy and handed %v, want 12", n)
	}
	if sum, count := histogram(m, "idemq_ledger_commit_requests"); sum != 12 || count != 5 {
		t.Errorf("commit requests sum %v count %v, want 12 and 5", sum, count)
	}
	if n := events(m, "idemq_ledger_events_total", "busy"); n != 0 {
		t.Errorf("a family the page lacks counts %v, want 0", n)
	}
}

// With River in the run, every other configuration's rate is also paired with River's of
// the same repetition, and River runs only on the workloads it can drain.
func TestDrainTablePairsWithRiver(t *testing.T) {
	var b bytes.Buffer
	err := WriteDrainTable(&b, []DrainSample{
		{Workload: "debit-distinct", Concurrency: 10, Config: DrainBare, Rep: 1, Deliveries: 100, PerSecond: 2000},
		{Workload: "debit-distinct", Concurrency: 10, Config: DrainRiver, Rep: 1, Deliveries: 100, PerSecond: 400},
		{Workload: "debit-distinct", Concurrency: 10, Config: DrainRiver, Rep: 2, Deliveries: 100, PerSecond: 800},
		{Workload: "debit-distinct", Concurrency: 10, Config: "worker×1", Rep: 1, Deliveries: 100, PerSecond: 1000},
		{Workload: "debit-distinct", Concurrency: 10, Config: "worker×1", Rep: 2, Deliveries: 100, PerSecond: 1000},
		{Workload: "debit-zipf", Concurrency: 10, Config: DrainBare, Rep: 1, Deliveries: 100, PerSecond: 2000},
		{Workload: "debit-zipf", Concurrency: 10, Config: "worker×1", Rep: 1, Deliveries: 100, PerSecond: 1000},
	})
	if err != nil {
		t.Fatal(err)
	}
	table := b.String()
	for _, want := range []string{
		"| ÷ bare (paired) | ÷ River (paired) |",
		"| worker×1 | 100 | 1000 (1000–1000) | **0.50** (0.50–0.50) | **1.88** (1.25–2.50) |", // bare ran in rep 1 only
		"| river | 100 | 600 (400–800) | **0.20** (0.20–0.20) | 1 |",
		"| bare | 100 | 2000 (2000–2000) | 1 | **5.00** (5.00–5.00) |",
		"| debit-zipf | 10 | worker×1 | 100 | 1000 (1000–1000) | **0.50** (0.50–0.50) | - |",
	} {
		if !strings.Contains(table, want) {
			t.Errorf("table:\n%s\nwant %q", table, want)
		}
	}
	opt := Options{DrainBinaries: []string{"idemq"}, DrainRiver: "riverdrain"}
	for name, want := range map[string]bool{"debit-distinct": true, "debit-hot": true, "debit-zipf": false, "charge-distinct": false} {
		got := slices.ContainsFunc(drainConfigs(opt, drainWorkloads[name]), func(c drainConfig) bool { return c.name == DrainRiver })
		if got != want {
			t.Errorf("%s: River among the configurations %v, want %v", name, got, want)
		}
	}
}

// TestDrainTiny runs `idemq-bench -drain` at its smallest: bare asynq in a child of its
// own (this test binary again) and `idemq worker` at 1 and 3 replicas, from an idemq
// binary built from this tree (-idemq build), drain the same 100 debits. It checks that
// every configuration drained every key once, never how fast.
func TestDrainTiny(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 3*time.Minute)
	jsonPath := filepath.Join(t.TempDir(), "bench-drain.json")
	var out, progress bytes.Buffer
	err := Main(ctx, envOr("REDIS_URL", testenv.DefaultRedisURL), envOr("DATABASE_URL", testenv.DefaultDatabaseURL),
		[]string{"-drain", "-reps", "1", "-drain-n", "100", "-drain-concurrency", "10", "-drain-workloads", "debit-distinct",
			"-idemq", "build", "-json", jsonPath}, &out, &progress)
	if err != nil {
		t.Fatalf("bench -drain: %v\nprogress:\n%s", err, progress.String())
	}
	b, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var rep struct{ Samples []DrainSample }
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatalf("decode %s: %v", jsonPath, err)
	}
	var configs []string
	for _, s := range rep.Samples {
		configs = append(configs, s.Config)
		if s.Keys != 100 || s.Effects != s.Keys || s.PerSecond <= 0 {
			t.Errorf("%s: %d keys, %d effects, %.0f deliveries/s; want 100 keys, one effect each", s.Config, s.Keys, s.Effects, s.PerSecond)
		}
	}
	slices.Sort(configs)
	if want := []string{DrainBare, "worker×1", "worker×3"}; !slices.Equal(configs, want) {
		t.Errorf("configurations = %v, want %v", configs, want)
	}
	if !strings.Contains(out.String(), "| worker×3 |") {
		t.Errorf("table has no worker×3 row:\n%s", out.String())
	}
}

// The step table takes bare asynq's CPU on the same checkouts off the worker's, divides
// by the three steps, and, with the leased one-effect base in the run, also takes off the
// base's own cost over bare asynq.
func TestDrainTableStepCost(t *testing.T) {
	samples := []DrainSample{
		{Workload: "checkout-distinct", Concurrency: 10, Config: DrainBare, Rep: 1, Deliveries: 100, PerSecond: 1000, InFlightMS: 10,
			CPUWorkers: 1000, CPURedis: 100, CPUPG: 500},
		{Workload: "checkout-distinct", Concurrency: 10, Config: "worker×1", Rep: 1, Deliveries: 100, PerSecond: 250, InFlightMS: 40,
			CPUWorkers: 1600, CPURedis: 160, CPUPG: 1100},
	}
	var b bytes.Buffer
	if err := WriteDrainTable(&b, samples); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"| checkout-distinct | 10 | worker×1 | 100 | 250 (250–250) | **0.25** (0.25–0.25) |",
		"| 40.0 |\n", // ms in flight, the main table's last column
		"| checkout-distinct | 10 | worker×1 | **0.25** (0.25–0.25) | 40.0 / 10.0 | 600 / 60 / 600 | 200 / 20 / 200 = 420 | - |",
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("table:\n%s\nwant %q", b.String(), want)
		}
	}

	samples = append(samples,
		DrainSample{Workload: "charge-distinct", Concurrency: 10, Config: DrainBare, Rep: 1, Deliveries: 100, PerSecond: 1000,
			CPUWorkers: 500, CPURedis: 50, CPUPG: 300},
		DrainSample{Workload: "charge-distinct", Concurrency: 10, Config: "worker×1", Rep: 1, Deliveries: 100, PerSecond: 500,
			CPUWorkers: 800, CPURedis: 80, CPUPG: 600})
	b.Reset()
	if err := WriteDrainTable(&b, samples); err != nil {
		t.Fatal(err)
	}
	if want := "| 200 / 20 / 200 = 420 | 100 / 10 / 100 = 210 (base charge-distinct) |"; !strings.Contains(b.String(), want) {
		t.Errorf("table:\n%s\nwant %q", b.String(), want)
	}

	b.Reset()
	if err := WriteDrainTable(&b, samples[2:]); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(b.String(), "Step records") {
		t.Errorf("a run without recorded steps printed the step table:\n%s", b.String())
	}
}

// TestDrainCheckoutTiny drains 100 checkouts through bare asynq (unguarded.Checkout) and
// `idemq worker` (three recorded steps each) at their smallest, and checks that every
// configuration made each checkout's three effects once and that only the worker recorded
// its steps, never how fast.
func TestDrainCheckoutTiny(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 3*time.Minute)
	jsonPath := filepath.Join(t.TempDir(), "bench-drain.json")
	var out, progress bytes.Buffer
	err := Main(ctx, envOr("REDIS_URL", testenv.DefaultRedisURL), envOr("DATABASE_URL", testenv.DefaultDatabaseURL),
		[]string{"-drain", "-reps", "1", "-drain-n", "100", "-drain-concurrency", "10", "-drain-workloads", "checkout-distinct",
			"-idemq", "build", "-json", jsonPath}, &out, &progress)
	if err != nil {
		t.Fatalf("bench -drain: %v\nprogress:\n%s", err, progress.String())
	}
	b, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var rep struct{ Samples []DrainSample }
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatalf("decode %s: %v", jsonPath, err)
	}
	if len(rep.Samples) != 3 {
		t.Fatalf("%d samples, want bare, worker×1 and worker×3", len(rep.Samples))
	}
	for _, s := range rep.Samples {
		steps := 3 * s.Keys
		if s.Config == DrainBare {
			steps = 0
		}
		if s.Keys != 100 || s.Effects != s.Keys || s.StepRows != steps || s.InFlightMS <= 0 {
			t.Errorf("%s: %d keys, %d effects, %d step records, %.1f ms in flight; want 100 keys, one effect each, %d step records",
				s.Config, s.Keys, s.Effects, s.StepRows, s.InFlightMS, steps)
		}
	}
	if !strings.Contains(out.String(), "| checkout-distinct | 10 | worker×1 | **") {
		t.Errorf("no step table row for worker×1:\n%s", out.String())
	}
}
