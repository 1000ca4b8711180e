package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/lock"
)

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// TestMain lets memory and API modes re-run this test binary as their child: with
// ChildEnv set, the binary is the child, not the tests.
func TestMain(m *testing.M) {
	if os.Getenv(ChildEnv) == "1" {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		// The arguments are the child's, its flag first.
		err := Main(ctx, os.Getenv("REDIS_URL"), os.Getenv("DATABASE_URL"), os.Args[1:], os.Stdout, os.Stderr)
		stop()
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestMainTiny runs `idemq-bench` at a tiny size over every workload: it checks that the
// command runs end to end and writes its table, JSON and chart, never how fast.
func TestMainTiny(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 2*time.Minute)
	dir := t.TempDir()
	jsonPath, svgPath := filepath.Join(dir, "bench.json"), filepath.Join(dir, "bench.svg")
	var out, progress bytes.Buffer
	err := Main(ctx, envOr("REDIS_URL", testenv.DefaultRedisURL), envOr("DATABASE_URL", testenv.DefaultDatabaseURL),
		[]string{"-n", "20", "-reps", "2", "-concurrency", "5", "-workloads", "noop,debit,charge,scale,io,latency,dup",
			"-servers", "1,2", "-io-wait", "1ms", "-latency-rate", "400", "-json", jsonPath, "-svg", svgPath}, &out, &progress)
	if err != nil {
		t.Fatalf("bench: %v\nprogress:\n%s", err, progress.String())
	}
	var rep Report
	b, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatalf("decode %s: %v", jsonPath, err)
	}
	// noop 6 + debit 4 + charge 4 + scale 2×3 + io 3 + latency 3 + dup 3 configurations,
	// 2 reps each.
	if got, want := len(rep.Samples), 2*(6+4+4+6+3+3+3); got != want {
		t.Errorf("samples = %d, want %d", got, want)
	}
	for _, s := range rep.Samples {
		if s.TasksPerSecond <= 0 || s.Errors != 0 {
			t.Errorf("%s/%d/%s rep %d: %.0f tasks/s, %d errors", s.Workload, s.Servers, s.Config, s.Rep, s.TasksPerSecond, s.Errors)
		}
		// Every configuration with the ledger reports how many requests its commits
		// carried (at least one each); the others none.
		if withLedger := strings.ContainsAny(s.Config, "CDEFG"); withLedger != (s.RowsPerCommit >= 1) {
			t.Errorf("%s/%d/%s rep %d: %.1f requests per commit", s.Workload, s.Servers, s.Config, s.Rep, s.RowsPerCommit)
		}
	}
	if got, want := strings.Count(out.String(), "\n| "), len(rep.Rows)+1; got != want {
		t.Errorf("table has %d rows, want %d:\n%s", got, want, out.String())
	}
	if svg, err := os.ReadFile(svgPath); err != nil || !bytes.HasPrefix(svg, []byte("<svg")) {
		t.Errorf("chart: %v %.40q", err, svg)
	}
}

// TestMemoryTiny runs `idemq-bench -memory` at a tiny size: each configuration in a
// child process (this test binary again), the table and JSON written. It checks the
// report's shape, never how much memory anything took.
func TestMemoryTiny(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 2*time.Minute)
	dir := t.TempDir()
	jsonPath, svgPath := filepath.Join(dir, "memory.json"), filepath.Join(dir, "memory.svg")
	var out, progress bytes.Buffer
	err := Main(ctx, envOr("REDIS_URL", testenv.DefaultRedisURL), envOr("DATABASE_URL", testenv.DefaultDatabaseURL),
		[]string{"-memory", "-memory-tasks", "500", "-concurrency", "5", "-memprofile", dir, "-json", jsonPath, "-svg", svgPath}, &out, &progress)
	if err != nil {
		t.Fatalf("bench -memory: %v\nprogress:\n%s", err, progress.String())
	}
	var rep Report
	b, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatalf("decode %s: %v", jsonPath, err)
	}
	if rep.Memory == nil {
		t.Fatalf("report has no memory section:\n%s", b)
	}
	var got []string
	for _, r := range rep.Memory.Results {
		got = append(got, r.Config)
		if r.Tasks != 500 || r.Errors != 0 || len(r.Samples) == 0 || r.PeakRSS <= 0 || r.RSSEnd <= 0 || r.GoHeap.HeapInuse == 0 {
			t.Errorf("%s: tasks %d, errors %d, %d samples, peak %d, end %d, heap in use %d", r.Config, r.Tasks, r.Errors, len(r.Samples), r.PeakRSS, r.RSSEnd, r.GoHeap.HeapInuse)
		}
		if r.Config != ConfigBare && r.PeakRatio <= 0 {
			t.Errorf("%s: no ratio to bare asynq", r.Config)
		}
		if _, err := os.Stat(r.Memprofile); err != nil {
			t.Errorf("%s: heap profile: %v", r.Config, err)
		}
	}
	if want := []string{ConfigBare, ConfigFull, ConfigFullTx}; !slices.Equal(got, want) {
		t.Errorf("configurations = %v, want %v", got, want)
	}
	if got, want := strings.Count(out.String(), "\n| "), len(rep.Memory.Results)+1; got != want {
		t.Errorf("table has %d rows, want %d:\n%s", got, want, out.String())
	}
	if svg, err := os.ReadFile(svgPath); err != nil || !bytes.HasPrefix(svg, []byte("<svg")) {
		t.Errorf("chart: %v %.40q", err, svg)
	}
}

// The benchmarks below call the handlers each configuration runs straight, without an
// asynq server, at parallelism 1 and 32, so the middleware's cost sits beside its floor:
//
//	BenchmarkHandler/A (bare no-op handler) — the floor
//	BenchmarkHandler/B (+ Redis lock), /C (+ Ledger.Do), /D (+ Ledger.DoTx)
//	BenchmarkHandler/E (asynqmw.Leased), /F (asynqmw.Transactional)
//
// Run them together: go test -run '^$' -bench . -benchtime 3s ./internal/bench/
func BenchmarkHandler(b *testing.B) {
	pool := testenv.Pool(b, testenv.PostgresURL(b)+"&pool_max_conns=40")
	rdb := testenv.Redis(b)
	ledger := idempotency.New(pool, nil)
	b.Cleanup(ledger.Close)
	locker := lock.New(rdb, nil)
	st := &stack{rdb: rdb, pool: pool, ledger: ledger, locker: locker,
		worker: asynqmw.NewWorker(ledger, locker, &asynqmw.Config{LockTTL: lockTTL, Redis: rdb})}
	w := noopWorkload("noop", 0)
	var seq atomic.Int64
	prefix := strconv.FormatInt(time.Now().UnixNano(), 36)
	for _, config := range w.configs {
		h := w.handler(config, st)
		for _, p := range []int{1, 32} {
			b.Run(fmt.Sprintf("%s/p=%d", config, p), func(b *testing.B) {
				ctx := context.Background()
				b.ReportAllocs()
				run := func() error {
					s := w.spec(prefix, int(seq.Add(1)))
					return h.ProcessTask(ctx, s.Task(s.Key, time.Now()))
				}
				if p == 1 {
					for b.Loop() {
						if err := run(); err != nil {
							b.Fatal(err)
						}
					}
					return
				}
				b.SetParallelism(max(1, p/runtime.GOMAXPROCS(0)))
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						if err := run(); err != nil {
							b.Error(err)
							return
						}
					}
				})
			})
		}
	}
}
