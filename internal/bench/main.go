package bench

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idemq/idemq/internal/localserver"
)

// idemqBinary resolves -idemq: the binary at flag, or with build, cmd/idemq built from
// this repository into a temporary directory that cleanup removes. The bench measures the
// binary users run, so it never plays idemq's worker or api itself.
func idemqBinary(ctx context.Context, flag string, progress io.Writer) (bin string, cleanup func(), err error) {
	if flag != "build" {
		if _, err := os.Stat(flag); err != nil {
			return "", nil, fmt.Errorf("bench: -idemq: %w", err)
		}
		return flag, func() {}, nil
	}
	dir, err := os.MkdirTemp("", "idemq-bench")
	if err != nil {
		return "", nil, fmt.Errorf("bench: %w", err)
	}
	bin = filepath.Join(dir, "idemq")
	fmt.Fprintln(progress, "bench: building cmd/idemq (-idemq build)")
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/idemq/idemq/cmd/idemq").CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return "", nil, fmt.Errorf("bench: -idemq build: run inside the repository, or give the binary's path: %w\n%s", err, out)
	}
	return bin, func() { os.RemoveAll(dir) }, nil
}

// Main is idemq-bench: it parses args, runs, prints the table to stdout (progress to
// stderr) and writes the JSON and the chart where asked.
//
// With a child flag first among args it is instead one of the bench's own children on
// redisURL and databaseURL until ctx ends: -memory-child (a memory-mode server, see
// RunMemory), -bare-child (drain mode's bare asynq, see RunDrain) or -api-child (API
// mode's load generator, see RunAPI).
func Main(ctx context.Context, redisURL, databaseURL string, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == childFlag {
		return runChild(ctx, redisURL, databaseURL, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == bareChildFlag {
		return runBareChild(ctx, redisURL, databaseURL, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == apiChildFlag {
		return runAPIChild(ctx, redisURL, databaseURL, args[1:], stdout, stderr)
	}
	fs := flag.NewFlagSet("idemq-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	opt := Options{RedisURL: redisURL, DatabaseURL: databaseURL}
	workloads := fs.String("workloads", "noop,debit,charge", "comma-separated workloads: noop, debit, charge (the main table), scale (1, 2, 4 servers), io (a handler sleeping -io-wait), latency (no-op tasks arriving at -latency-rate, concurrency 10), dup (every no-op key delivered 3 times); or api alone (the web side: see the -api flags)")
	fs.IntVar(&opt.Reps, "reps", 3, "repetitions; each runs every configuration once, interleaved")
	fs.Float64Var(&opt.Seconds, "seconds", 2, "drain time each measurement aims at (N is sized from the configuration's last rate); a full run uses 15")
	fs.IntVar(&opt.N, "n", 0, "fixed number of tasks per measurement (0: sized by -seconds)")
	fs.IntVar(&opt.WarmupN, "warmup", 500, "tasks of the unrecorded warm-up of each configuration (negative: none)")
	fs.IntVar(&opt.Concurrency, "concurrency", 50, "concurrency of each asynq server")
	fs.IntVar(&opt.PoolBudget, "pool", 40, "Postgres connections shared by a measurement's servers (each gets the worker's pool, min(concurrency+4, 4 × cores + 8), at most pool/servers)")
	servers := fs.String("servers", "1,2,4", "server counts of the scale workload")
	fs.DurationVar(&opt.IOWait, "io-wait", 10*time.Millisecond, "simulated I/O of the io workload's handler")
	fs.Float64Var(&opt.LatencyRate, "latency-rate", 200, "arrival rate (tasks/s) of the latency workload (concurrency 10, no queue: the unloaded overhead)")
	jsonPath := fs.String("json", "", "write the report as JSON here (default docs/bench/bench.json with -write-docs)")
	svgPath := fs.String("svg", "", "write the chart here (default docs/bench/bench.svg with -write-docs)")
	writeDocs := fs.Bool("write-docs", false, "write docs/bench/bench.json and docs/bench/bench.svg (run from the repository root)")
	memory := fs.Bool("memory", false, "measure memory instead of throughput: each configuration of -memory-configs in a process of its own serves -memory-tasks no-op tasks while its RSS is sampled")
	fs.IntVar(&opt.MemoryTasks, "memory-tasks", 100000, "no-op tasks each configuration serves in -memory mode")
	memoryConfigs := fs.String("memory-configs", "A,E,F", "configurations of -memory mode: A (bare asynq), E (full stack leased), F (full stack tx)")
	fs.StringVar(&opt.MemProfileDir, "memprofile", "", "-memory mode: each child writes a heap profile to DIR/memory-<config>.pprof at the end of the load")
	configs := fs.String("configs", "", "only these configurations (comma-separated letters B–G; A, bare asynq, always runs)")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of this process (the servers, the middleware, pgx and go-redis) to FILE")
	from := fs.String("from", "", "do not measure: print the table and write the chart (and JSON) of the report in this JSON file")
	showFlags := fs.Bool("flags", false, "list the flags and exit")
	drain := fs.Bool("drain", false, "measure the binaries instead: `idemq worker` (1 and 3 replicas, defaults but IDEMQ_CONCURRENCY) against bare asynq in a process of its own, draining the same tasks from a plain asynq client, paired per repetition")
	fs.IntVar(&opt.DrainN, "drain-n", 10000, "-drain: keys of a drain over distinct scopes (hot and Zipf workloads take a share)")
	drainConc := fs.String("drain-concurrency", "10,50", "-drain: concurrencies to run each workload at")
	drainWorkloadsFlag := fs.String("drain-workloads", strings.Join(DrainWorkloadNames, ","), "-drain: workloads (checkout-distinct: order:checkout, three recorded steps in the worker against unguarded.Checkout's same effects in bare asynq, with a table of the step records' cost; run it with charge-distinct to also take off a leased one-effect job's cost)")
	fs.DurationVar(&opt.DrainTimeout, "drain-timeout", 5*time.Minute, "-drain: time limit of one drain")
	fs.IntVar(&opt.DrainPrefill, "drain-prefill", 5_000_000, "-drain: completed rows in the ledger before each drain of debit-prefilled (about 1.8 GB with its indexes per 5,000,000; written once per run, in a few minutes)")
	fs.StringVar(&opt.DrainRiver, "drain-river", "", "-drain: also drain debit-distinct and debit-hot through River (configuration river: each debit's entry and its job's completion in one transaction), with the riverdrain binary at `PATH`, or build to build internal/bench/river first (run from the repository root)")
	drainBinaries := fs.String("drain-binaries", "", "-drain: comma-separated idemq binaries whose `worker` to compare, side by side in one run (default: -idemq)")
	fs.Float64Var(&opt.API.Seconds, "api-seconds", 10, "-workloads api: how long the load of each throughput sample runs")
	fs.IntVar(&opt.API.Concurrency, "api-concurrency", 50, "-workloads api: calls in flight of each throughput sample")
	apiBinaries := fs.String("api-binaries", "", "-workloads api: comma-separated idemq binaries whose api (and worker, for e2e) to compare side by side (default: -idemq)")
	idemqBin := fs.String("idemq", "build", "-drain, -soak and -workloads api: the idemq binary whose worker and api they run, at `PATH`, or build to build cmd/idemq into a temporary directory first (run inside the repository)")
	apiPaths := fs.String("api-paths", strings.Join(APIPathNames, ","), "-workloads api: paths: api (POST /v1/charges to idemq api), asynq (asynq's client), insert (one INSERT per request), enqueue and enqueuetx (the outbox client from Go), e2e (debits through the api to a worker at -api-e2e-rate)")
	fs.Float64Var(&opt.API.E2ERate, "api-e2e-rate", 20, "-workloads api: debits per second of the e2e path")
	fs.Float64Var(&opt.API.E2ESeconds, "api-e2e-seconds", 10, "-workloads api: how long the e2e path sends")
	fs.DurationVar(&opt.API.Sustain, "api-sustain", 0, "-workloads api: instead of the paths, one sustained run this long per binary of -api-binaries: debits at -api-sustain-rate through idemq api (Idempotency-Key rows kept 2m, purged every 1m) to 3 idemq workers, sampled every -api-sustain-every, then every job's completion and effect checked (10m for a soak; writes docs/bench/bench-api-sustain.json with -write-docs)")
	fs.Float64Var(&opt.API.SustainRate, "api-sustain-rate", 1500, "-workloads api -api-sustain: debits per second, sent open loop")
	fs.DurationVar(&opt.API.SustainEvery, "api-sustain-every", 30*time.Second, "-workloads api -api-sustain: time between samples")
	soak := fs.Bool("soak", false, "a steady-state soak of the idemq binary's worker instead, on a private Postgres (pg_stat_statements loaded): its maximum on -soak-workload measured by a drain, then -soak-minutes at -soak-rate-frac of it with IDEMQ_RETENTION -soak-retention, a row a minute (completions, latency, the ledger tables' sizes and dead tuples, autovacuums, the purge's rows and longest statement, lock waits) and PASS/FAIL per target at the end")
	addSoakFlags(fs, &opt.Soak)
	privatePG := fs.Bool("private-postgres", false, "run against a Postgres of its own (a fresh cluster on a free loopback port, Postgres's defaults but fsync on and shared_buffers 128MB, autovacuum on) instead of DATABASE_URL's")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "Usage: idemq-bench [flags]\n\nThe defaults (3 reps × ~2 s per measurement, noop/debit/charge) take about 2 minutes\n(105 s on a shared 2-core machine).\nA full run (about 20–30 minutes): idemq-bench -seconds 15 -workloads noop,debit,charge,scale,io -write-docs\nMemory (A, E, F × 100,000 tasks, a few minutes): idemq-bench -memory\nThe web side (3 reps × 6 paths × 10 s, about 5 minutes): idemq-bench -workloads api -write-docs\nThe web side sustained (about 12 minutes): idemq-bench -workloads api -api-sustain 10m -write-docs\nA soak of the worker (about 40 minutes): idemq-bench -soak -json soak.json\n\nFlags:")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *showFlags {
		fs.SetOutput(stdout)
		fs.Usage()
		return nil
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("bench: unexpected arguments %q", fs.Args())
	}
	settings := []string{"shared_buffers=128MB"}
	if *soak {
		*privatePG = true // the soak's sizes, vacuums and statements are its own
		settings = append(settings, soakPostgresSettings...)
	}
	if *privatePG {
		pg, err := localserver.StartPostgres(settings...)
		if err != nil {
			return fmt.Errorf("bench: -private-postgres: %w", err)
		}
		defer pg.Close()
		opt.DatabaseURL = pg.URL
		fmt.Fprintf(stderr, "bench: a private Postgres on port %d\n", pg.Port())
	}
	opt.Workloads = strings.Split(*workloads, ",")
	for _, c := range strings.Split(*configs, ",") {
		if c = strings.TrimSpace(c); c == "" {
			continue
		}
		if _, ok := ConfigNames[c]; !ok {
			return fmt.Errorf("bench: -configs: %q is not one of A–G", c)
		}
		opt.Configs = append(opt.Configs, c)
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return fmt.Errorf("bench: -cpuprofile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("bench: -cpuprofile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	for _, c := range strings.Split(*memoryConfigs, ",") {
		switch c = strings.TrimSpace(c); c {
		case ConfigBare, ConfigFull, ConfigFullTx:
			opt.MemoryConfigs = append(opt.MemoryConfigs, c)
		default:
			return fmt.Errorf("bench: -memory-configs: %q is not A, E or F", c)
		}
	}
	for _, s := range strings.Split(*servers, ",") {
		k, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || k < 1 {
			return fmt.Errorf("bench: -servers: %q is not a positive whole number", s)
		}
		opt.ScaleServers = append(opt.ScaleServers, k)
	}
	if *soak {
		bin, cleanup, err := idemqBinary(ctx, *idemqBin, stderr)
		if err != nil {
			return err
		}
		defer cleanup()
		opt.Binary = bin
		if *writeDocs && *jsonPath == "" {
			*jsonPath = filepath.Join("docs", "bench", "bench-soak.json")
		}
		return mainSoak(ctx, opt, *jsonPath, stdout, stderr)
	}
	if slices.Contains(opt.Workloads, "api") {
		if len(opt.Workloads) > 1 {
			return fmt.Errorf("bench: -workloads api runs alone, not with %q", *workloads)
		}
		opt.API.Paths = splitList(*apiPaths)
		opt.API.Binaries = splitList(*apiBinaries)
		if len(opt.API.Binaries) == 0 && (opt.API.Sustain > 0 || slices.Contains(opt.API.Paths, APIPathAPI) || slices.Contains(opt.API.Paths, APIPathE2E)) {
			bin, cleanup, err := idemqBinary(ctx, *idemqBin, stderr)
			if err != nil {
				return err
			}
			defer cleanup()
			opt.Binary = bin
		}
		if opt.API.Sustain > 0 {
			if *writeDocs && *jsonPath == "" {
				*jsonPath = filepath.Join("docs", "bench", "bench-api-sustain.json")
			}
			return mainAPISustain(ctx, opt, *jsonPath, stdout, stderr)
		}
		if *writeDocs && *jsonPath == "" {
			*jsonPath = filepath.Join("docs", "bench", "bench-api.json")
		}
		rep, err := RunAPI(ctx, opt, stderr)
		if err != nil {
			return err
		}
		if err := WriteAPITable(stdout, rep.Samples); err != nil {
			return err
		}
		if *jsonPath != "" {
			return writeJSON(*jsonPath, rep)
		}
		return nil
	}
	if *drain {
		opt.DrainWorkloads = strings.Split(*drainWorkloadsFlag, ",")
		for _, b := range strings.Split(*drainBinaries, ",") {
			if b = strings.TrimSpace(b); b != "" {
				opt.DrainBinaries = append(opt.DrainBinaries, b)
			}
		}
		for _, c := range strings.Split(*drainConc, ",") {
			k, err := strconv.Atoi(strings.TrimSpace(c))
			if err != nil || k < 1 {
				return fmt.Errorf("bench: -drain-concurrency: %q is not a positive whole number", c)
			}
			opt.DrainConcurrency = append(opt.DrainConcurrency, k)
		}
		if *writeDocs && *jsonPath == "" {
			*jsonPath = filepath.Join("docs", "bench", "bench-drain.json")
		}
		if len(opt.DrainBinaries) == 0 {
			bin, cleanup, err := idemqBinary(ctx, *idemqBin, stderr)
			if err != nil {
				return err
			}
			defer cleanup()
			opt.Binary = bin
		}
		if opt.DrainRiver == "build" {
			bin, err := buildRiverdrain(ctx)
			if err != nil {
				return err
			}
			defer os.RemoveAll(filepath.Dir(bin))
			opt.DrainRiver = bin
		}
		samples, err := RunDrain(ctx, opt, stderr)
		if err != nil {
			return err
		}
		if err := WriteDrainTable(stdout, samples); err != nil {
			return err
		}
		if *jsonPath != "" {
			return writeJSON(*jsonPath, map[string]any{"revision": revision(), "options": opt, "samples": samples})
		}
		return nil
	}
	if *writeDocs {
		base := "bench"
		if *memory {
			base = "bench-memory"
		}
		if *jsonPath == "" {
			*jsonPath = filepath.Join("docs", "bench", base+".json")
		}
		if *svgPath == "" {
			*svgPath = filepath.Join("docs", "bench", base+".svg")
		}
	}
	var rep *Report
	if *from != "" {
		b, err := os.ReadFile(*from)
		if err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		rep = &Report{}
		if err := json.Unmarshal(b, rep); err != nil {
			return fmt.Errorf("bench: %s: %w", *from, err)
		}
	} else {
		started := time.Now()
		run := Run
		if *memory {
			run = RunMemory
		}
		var err error
		if rep, err = run(ctx, opt, stderr); err != nil {
			return err
		}
		rep.WallSeconds = time.Since(started).Seconds()
	}
	if err := rep.WriteTable(stdout); err != nil {
		return err
	}
	var errs []error
	if *jsonPath != "" {
		errs = append(errs, writeFile(*jsonPath, rep.WriteJSON))
	}
	if *svgPath != "" {
		errs = append(errs, writeFile(*svgPath, rep.WriteSVG))
	}
	return errors.Join(errs...)
}

// splitList returns the comma-separated items of s, trimmed, without empty ones.
func splitList(s string) []string {
	var out []string
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			out = append(out, v)
		}
	}
	return out
}

// writeJSON writes v to path as indented JSON.
func writeJSON(path string, v any) error {
	return writeFile(path, func(w io.Writer) error {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	})
}

func writeFile(path string, write func(io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	if err := write(f); err != nil {
		f.Close()
		return fmt.Errorf("bench: write %s: %w", path, err)
	}
	return f.Close()
}
