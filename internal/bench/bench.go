package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"time"
)

// Options configures a run. Main fills it from flags; the zero value of a field means
// its default, written in the field's doc.
type Options struct {
	RedisURL    string // Redis server; the run leases an empty database on it
	DatabaseURL string // Postgres database; the run creates, migrates and drops a schema on it

	// Workloads to measure, in order: noop, debit, charge (the main table), scale (1, 2
	// and 4 servers) and io (a handler that sleeps Options.IOWait). Default: noop, debit,
	// charge.
	Workloads []string
	// Reps is the number of repetitions; each runs every configuration once, interleaved.
	// Default 3.
	Reps int
	// Seconds is the drain time each measurement aims at: N is sized from the rate the
	// configuration reached in the warm-up or the previous repetition. Default 2.
	Seconds float64
	// N, when positive, fixes the number of tasks of every measurement instead.
	N int
	// MinN and MaxN bound an automatic N. Defaults 200 and 200000.
	MinN, MaxN int
	// Warmup runs every configuration once, unrecorded, with WarmupN tasks before the
	// first repetition (it also gives the first estimate of each rate). Default 500;
	// negative skips the warm-up.
	WarmupN int
	// Concurrency is each asynq server's concurrency. Default 50.
	Concurrency int
	// PoolBudget is the Postgres connections a measurement's servers share; each server
	// gets the worker's pool (server.PoolSize), at most PoolBudget/servers, at least
	// 4. Default 40.
	PoolBudget int
	// ScaleServers are the server counts of the scale workload. Default 1, 2, 4.
	ScaleServers []int
	// IOWait is the simulated I/O of the io workload's handler. Default 10ms.
	IOWait time.Duration
	// LatencyRate is the arrival rate (tasks per second) of the latency workload, whose
	// servers run at concurrency 10. Default 200.
	LatencyRate float64
	// Configs, when set, limits every workload to these configurations; bare asynq (A)
	// always runs, as the base of the ratios.
	Configs []string

	// Binary is the idemq binary whose worker and api drain and API modes run (RunDrain,
	// RunAPI, RunAPISustain) when DrainBinaries or APIOptions.Binaries is empty. No
	// default: Main builds it from cmd/idemq (-idemq).
	Binary string
	// Self is the executable that plays the bench's own child roles: drain mode's bare
	// asynq (-bare-child), API mode's load generator (-api-child) and memory mode's servers
	// (-memory-child), each the child flag first among its arguments, then Main's routing.
	// Default: this executable (idemq-bench, or a test binary that routes ChildEnv).
	Self string
	// DrainBinaries are the worker binaries drain mode compares, each at 1 and 3
	// replicas. Default: Binary.
	DrainBinaries []string
	// DrainRiver, when set, is a riverdrain binary (internal/bench/river): drain mode
	// then also drains the debit-distinct and debit-hot workloads through River
	// (configuration "river"), paired with the others.
	DrainRiver string
	// DrainN is the keys of a drain over distinct scopes; hot and Zipf workloads take a
	// share of it. Default 10000.
	DrainN int
	// DrainConcurrency are the concurrencies drain mode runs every workload at. Default
	// 10 (the worker's default) and 50.
	DrainConcurrency []int
	// DrainWorkloads are drain mode's workloads (DrainWorkloadNames). Default all.
	DrainWorkloads []string
	// DrainTimeout bounds one drain. Default 5m.
	DrainTimeout time.Duration
	// DrainPrefill is how many completed rows the ledger holds before each drain of the
	// debit-prefilled workload (30 days of keys, as the default retention keeps). Default
	// 5,000,000.
	DrainPrefill int

	// MemoryTasks is the no-op tasks each configuration's child serves in memory mode
	// (RunMemory). Default 100000.
	MemoryTasks int
	// MemoryConfigs are the configurations memory mode runs, each in a process of its
	// own: A (bare asynq), E (full stack leased), F (full stack transactional). Default
	// A, E, F.
	MemoryConfigs []string
	// MemProfileDir, when set, is where each memory-mode child writes its heap profile
	// (memory-<config>.pprof) at the end of the load.
	MemProfileDir string

	// API configures API mode (RunAPI, -workloads api).
	API APIOptions

	// Soak configures soak mode (RunSoak, -soak).
	Soak SoakOptions

	// binaryMigrates has setup migrate the schema with the idemq binary's `migrate`
	// (DrainBinaries) even when there is one.
	binaryMigrates bool
}

func (o *Options) defaults() {
	if len(o.Workloads) == 0 {
		o.Workloads = []string{"noop", "debit", "charge"}
	}
	if o.Reps <= 0 {
		o.Reps = 3
	}
	if o.Seconds <= 0 {
		o.Seconds = 2
	}
	if o.MinN <= 0 {
		o.MinN = 200
	}
	if o.MaxN <= 0 {
		o.MaxN = 200000
	}
	if o.WarmupN == 0 {
		o.WarmupN = 500
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 50
	}
	if o.PoolBudget <= 0 {
		o.PoolBudget = 40
	}
	if len(o.ScaleServers) == 0 {
		o.ScaleServers = []int{1, 2, 4}
	}
	if o.IOWait <= 0 {
		o.IOWait = 10 * time.Millisecond
	}
	if o.Self == "" {
		o.Self, _ = os.Executable()
	}
	if len(o.DrainBinaries) == 0 && o.Binary != "" {
		o.DrainBinaries = []string{o.Binary}
	}
	if o.DrainN <= 0 {
		o.DrainN = 10000
	}
	if len(o.DrainConcurrency) == 0 {
		o.DrainConcurrency = []int{10, 50}
	}
	if len(o.DrainWorkloads) == 0 {
		o.DrainWorkloads = DrainWorkloadNames
	}
	if o.DrainTimeout <= 0 {
		o.DrainTimeout = 5 * time.Minute
	}
	if o.DrainPrefill <= 0 {
		o.DrainPrefill = 5_000_000
	}
	if o.MemoryTasks <= 0 {
		o.MemoryTasks = 100000
	}
	if o.LatencyRate <= 0 {
		o.LatencyRate = 200
	}
	if len(o.MemoryConfigs) == 0 {
		o.MemoryConfigs = []string{ConfigBare, ConfigFull, ConfigFullTx}
	}
}

// CPU is CPU time per task, in microseconds, by party.
type CPU struct {
	Go       float64 `json:"go_us"`       // this process: asynq, the middleware, the in-process provider, pgx, go-redis
	Redis    float64 `json:"redis_us"`    // the redis-server process (shared: other clients' load counts too)
	Postgres float64 `json:"postgres_us"` // this run's backends + WAL writer, checkpointer, background writer
	Total    float64 `json:"total_us"`
}

// Sample is one measurement.
type Sample struct {
	Workload       string  `json:"workload"`
	Config         string  `json:"config"`
	Servers        int     `json:"servers"`
	Concurrency    int     `json:"concurrency"`
	PoolPerServer  int     `json:"pool_per_server"`
	Rep            int     `json:"rep"`
	N              int     `json:"n"`
	DrainSeconds   float64 `json:"drain_s"`
	TasksPerSecond float64 `json:"tasks_per_s"`
	OverheadP50us  float64 `json:"overhead_p50_us"`
	OverheadP99us  float64 `json:"overhead_p99_us"`
	CPU            CPU     `json:"cpu_per_task"`
	Errors         int     `json:"errors"`
	// Busy counts deliveries answered busy (a duplicate of a key in flight, a lock
	// held): retried by asynq, not failures.
	Busy int `json:"busy"`
	// RowsPerCommit is how many ledger requests (claims, completions, DoTx deliveries)
	// one shared commit carried on average; 0 without the ledger.
	RowsPerCommit float64 `json:"rows_per_commit"`
	// Ratios to bare asynq (configuration A) of the same workload, server count and
	// repetition.
	ThroughputRatio float64 `json:"throughput_ratio"`
	CPURatio        float64 `json:"cpu_ratio"`
}

// Report is a whole run.
type Report struct {
	Started     time.Time `json:"started"`
	WallSeconds float64   `json:"wall_s"`
	Host        Host      `json:"host"`
	Options     struct {
		Workloads    []string `json:"workloads"`
		Reps         int      `json:"reps"`
		Seconds      float64  `json:"seconds"`
		N            int      `json:"n,omitempty"`
		Concurrency  int      `json:"concurrency"`
		PoolBudget   int      `json:"pool_budget"`
		ScaleServers []int    `json:"scale_servers"`
		IOWaitMS     float64  `json:"io_wait_ms"`
		LatencyRate  float64  `json:"latency_rate,omitempty"`
	} `json:"options"`
	Samples []Sample `json:"samples,omitempty"`
	Rows    []Row    `json:"rows,omitempty"`
	// Memory is memory mode's result (-memory), which runs instead of the throughput
	// measurements.
	Memory *MemoryReport `json:"memory,omitempty"`
}

// Host describes where the run happened.
type Host struct {
	CPUs      int    `json:"cpus"`
	GoVersion string `json:"go"`
	Hostname  string `json:"hostname"`
	Load      string `json:"loadavg_at_start"`
	Revision  string `json:"revision,omitempty"` // the commit the binary was built from ("+dirty" when modified)
}

func revision() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	var rev, dirty string
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				dirty = "+dirty"
			}
		}
	}
	if rev == "" {
		return ""
	}
	return rev[:min(12, len(rev))] + dirty
}

// Run measures opt's workloads and returns the report; progress lines go to progress.
func Run(ctx context.Context, opt Options, progress io.Writer) (*Report, error) {
	opt.defaults()
	rep := newReport(opt)

	e, err := setup(ctx, opt)
	if err != nil {
		return nil, err
	}
	defer e.close()

	// The plan: one list of (workload, servers, config), run in this order every
	// repetition.
	type step struct {
		w       *workload
		servers int
		config  string
	}
	var plan []step
	add := func(s step) {
		if s.config == ConfigBare || len(opt.Configs) == 0 || slices.Contains(opt.Configs, s.config) {
			plan = append(plan, s)
		}
	}
	for _, name := range opt.Workloads {
		switch name {
		case "noop":
			w := noopWorkload("noop", 0)
			for _, c := range w.configs {
				add(step{w, 1, c})
			}
		case "debit", "charge":
			w := debitWorkload()
			if name == "charge" {
				w = chargeWorkload(e.charger)
			}
			for _, c := range w.configs {
				add(step{w, 1, c})
			}
		case "scale":
			w := noopWorkload("scale", 0)
			for _, k := range opt.ScaleServers {
				for _, c := range []string{ConfigBare, ConfigFull, ConfigFullTx} {
					add(step{w, k, c})
				}
			}
		case "io":
			w := noopWorkload("io", opt.IOWait)
			for _, c := range w.configs {
				add(step{w, 1, c})
			}
		case "dup":
			w := dupWorkload()
			for _, c := range w.configs {
				add(step{w, 1, c})
			}
		case "latency":
			w := latencyWorkload(opt.LatencyRate)
			for _, c := range w.configs {
				add(step{w, 1, c})
			}
		default:
			return nil, fmt.Errorf("bench: unknown workload %q (want noop, debit, charge, scale, io, latency, dup)", name)
		}
	}
	key := func(s step) string { return fmt.Sprintf("%s/%d/%s", s.w.name, s.servers, s.config) }
	rate := map[string]float64{}
	size := func(s step) int {
		if opt.N > 0 {
			return opt.N
		}
		r, ok := rate[key(s)]
		if !ok {
			r = 1000
		}
		return min(max(int(r*opt.Seconds), opt.MinN), opt.MaxN)
	}
	start := time.Now()
	if opt.WarmupN > 0 && opt.N <= 0 {
		fmt.Fprintf(progress, "warm-up: %d configurations × %d tasks\n", len(plan), opt.WarmupN)
		for _, s := range plan {
			smp, err := e.measure(ctx, s.w, s.config, s.servers, opt.WarmupN, 0)
			if err != nil {
				return nil, err
			}
			rate[key(s)] = smp.TasksPerSecond
		}
	}
	for r := 1; r <= opt.Reps; r++ {
		for _, s := range plan {
			smp, err := e.measure(ctx, s.w, s.config, s.servers, size(s), r)
			if err != nil {
				return nil, err
			}
			rate[key(s)] = smp.TasksPerSecond
			rep.Samples = append(rep.Samples, smp)
			fmt.Fprintf(progress, "rep %d/%d  %-6s k=%d %s %-22s n=%-6d %8.0f tasks/s  drain %5.2fs  overhead p50 %7.0fµs p99 %7.0fµs  cpu %6.0fµs/task  errors %d\n",
				r, opt.Reps, s.w.name, s.servers, s.config, ConfigNames[s.config], smp.N, smp.TasksPerSecond, smp.DrainSeconds, smp.OverheadP50us, smp.OverheadP99us, smp.CPU.Total, smp.Errors)
		}
	}
	rep.WallSeconds = time.Since(start).Seconds()
	rep.summarize()
	return rep, nil
}

// newReport starts a report: where and how it runs.
func newReport(opt Options) *Report {
	rep := &Report{Started: time.Now().UTC()}
	rep.Host.CPUs = runtime.NumCPU()
	rep.Host.GoVersion = runtime.Version()
	rep.Host.Hostname, _ = os.Hostname()
	rep.Host.Revision = revision()
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		rep.Host.Load = strings.Join(strings.Fields(string(b))[:3], " ")
	}
	o := &rep.Options
	o.Workloads, o.Reps, o.Seconds, o.N, o.Concurrency, o.PoolBudget, o.ScaleServers = opt.Workloads, opt.Reps, opt.Seconds, opt.N, opt.Concurrency, opt.PoolBudget, opt.ScaleServers
	o.IOWaitMS = float64(opt.IOWait) / 1e6
	o.LatencyRate = opt.LatencyRate
	return rep
}
