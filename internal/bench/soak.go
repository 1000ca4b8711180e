package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idemq/idemq/idempotency/server"
	"github.com/idemq/idemq/tasks"
)

// Soak mode (-soak, RunSoak) runs one `idemq worker` for half an hour or more at a steady
// share of its own maximum, with a retention short enough that the ledger's purge has
// rows to delete within minutes, and reads every minute whether anything drifts: the
// completion rate, the delivery latency, the ledger tables' sizes and dead tuples,
// autovacuum, the purge's rows and statement times, and lock waits on the hot path. It
// runs on a private Postgres (pg_stat_statements loaded) and measures the maximum first,
// with a drain of the same workload (RunDrain's machinery).

// SoakOptions configures soak mode. The zero value of a field means its default.
type SoakOptions struct {
	// Minutes is how long the steady load runs, each minute sampled. Default 35.
	Minutes int `json:"minutes"`
	// RateFrac is the share of the maximum the producer enqueues at. Default 0.7.
	RateFrac float64 `json:"rate_frac"`
	// Retention is the worker's IDEMQ_RETENTION; the bench lowers the worker's task
	// bounds (IDEMQ_TASK_RETENTION, IDEMQ_TASK_MAX_RETRY, IDEMQ_BUSY_BUDGET) so that the
	// worker accepts it, and enqueues within them. At least 1m45s with the worker's
	// lease, 1m with a Lease of 7s. Default 5m.
	Retention time.Duration `json:"retention"`
	// Workload is the drain workload whose debits the producer enqueues: one of
	// SoakWorkloadNames. Default debit-distinct.
	Workload string `json:"workload"`
	// MaxSeconds is how long the drain that measures the maximum aims to take. Default 60.
	MaxSeconds float64 `json:"max_seconds"`
	// MaxRate, when positive, is taken as the maximum (jobs per second) instead of
	// measuring it.
	MaxRate float64 `json:"max_rate,omitempty"`
	// Dup is the share of enqueues that enqueue again the payload of a key enqueued in
	// the last 10 seconds (each answered from the ledger, a duplicate event in its key's
	// history). Default 0.05; negative for none.
	Dup float64 `json:"dup"`
	// Producers are the goroutines the producer enqueues from. Default 4.
	Producers int `json:"producers"`
	// Lease, when set, is the worker's IDEMQ_LEASE, whose double is the least busy
	// budget the worker takes: a smoke run's 1-minute retention needs 7s. Default: the
	// worker's own (30s).
	Lease time.Duration `json:"lease,omitempty"`
}

func (s *SoakOptions) defaults() {
	if s.Minutes <= 0 {
		s.Minutes = 35
	}
	if s.RateFrac <= 0 {
		s.RateFrac = 0.7
	}
	if s.Retention <= 0 {
		s.Retention = 5 * time.Minute
	}
	if s.Workload == "" {
		s.Workload = "debit-distinct"
	}
	if s.MaxSeconds <= 0 {
		s.MaxSeconds = 60
	}
	if s.Dup == 0 {
		s.Dup = 0.05
	}
	s.Dup = max(s.Dup, 0)
	if s.Producers <= 0 {
		s.Producers = 4
	}
}

// SoakWorkloadNames are the drain workloads a soak can run: debits, one delivery per key
// (their wallet entries time each job).
var SoakWorkloadNames = []string{"debit-distinct", "debit-sql", "debit-hot", "debit-zipf"}

// soakPostgresSettings are what a soak's private Postgres runs with besides the bench's
// usual settings: pg_stat_statements loaded, I/O timed.
var soakPostgresSettings = []string{"shared_preload_libraries=pg_stat_statements", "track_io_timing=on"}

// soakSettle is how long after a minute's end its sample is taken: the transactions
// that began within it have committed by then.
const soakSettle = 5 * time.Second

// soakLatency says what a soak's latency measures.
const soakLatency = "enqueue to completion: from the producer's clock just before asynq's Enqueue (carried in the debit's reference) " +
	"to the start of the transaction that wrote the wallet entry and completed the job in the ledger (the entry's created_at, " +
	"the ledger row's completed_at: both now() of that transaction); first deliveries only"

// addSoakFlags declares soak mode's flags on fs, filling s.
func addSoakFlags(fs *flag.FlagSet, s *SoakOptions) {
	fs.IntVar(&s.Minutes, "soak-minutes", 35, "-soak: minutes of steady load, each sampled (a smoke run: 3)")
	fs.Float64Var(&s.RateFrac, "soak-rate-frac", 0.7, "-soak: enqueue rate as a share of the worker's maximum on the workload")
	fs.DurationVar(&s.Retention, "soak-retention", 5*time.Minute, "-soak: the worker's IDEMQ_RETENTION (at least 1m45s, or 1m with -soak-lease 7s; the bench lowers IDEMQ_TASK_RETENTION, IDEMQ_TASK_MAX_RETRY and IDEMQ_BUSY_BUDGET to fit and enqueues within them); the first retention period is the warm-up")
	fs.StringVar(&s.Workload, "soak-workload", "debit-distinct", "-soak: the workload enqueued: "+strings.Join(SoakWorkloadNames, ", "))
	fs.Float64Var(&s.MaxSeconds, "soak-max-seconds", 60, "-soak: how long the drain that measures the maximum aims to take")
	fs.Float64Var(&s.MaxRate, "soak-max", 0, "-soak: take this as the maximum (jobs/s) instead of measuring it")
	fs.Float64Var(&s.Dup, "soak-dup", 0.05, "-soak: share of enqueues that enqueue a key of the last 10 s again (negative: none)")
	fs.IntVar(&s.Producers, "soak-producers", 4, "-soak: goroutines the producer enqueues from")
	fs.DurationVar(&s.Lease, "soak-lease", 0, "-soak: the worker's IDEMQ_LEASE (default its own, 30s); the busy budget is two leases, so a retention under 1m45s needs a shorter one: a smoke run of -soak-retention 1m, 7s")
}

// soakTaskBounds returns the worker's task bounds for a retention and a lease (0: the
// worker's default): a task retention of 1s (a plain asynq.Enqueue keeps none), a busy
// budget of two leases (the least the worker takes), and the most retries, from 1 to
// the example tasks' 10, whose horizon still fits.
func soakTaskBounds(retention, lease time.Duration) (maxRetry int, busy time.Duration, err error) {
	if lease <= 0 {
		lease = server.DefaultLease
	}
	busy = 2 * lease
	if min := server.MinRetention(time.Second, 1, busy); retention < min {
		return 0, 0, fmt.Errorf("bench: -soak-retention %s: with a lease of %s the worker accepts %s at the least "+
			"(1s of task retention, one retry's horizon, a busy budget of two leases): give a longer retention or a shorter -soak-lease",
			retention, lease, min)
	}
	maxRetry = 1
	for maxRetry < tasks.DefaultMaxRetry && server.MinRetention(time.Second, maxRetry+1, busy) <= retention {
		maxRetry++
	}
	return maxRetry, busy, nil
}

// soakWorkerEnv is what a soak's worker runs with besides its connections, and the
// retries its tasks are enqueued with.
func soakWorkerEnv(w drainWorkload, s SoakOptions) ([]string, int, error) {
	maxRetry, busy, err := soakTaskBounds(s.Retention, s.Lease)
	if err != nil {
		return nil, 0, err
	}
	env := append(slices.Clone(w.workerEnv), "IDEMQ_RETENTION="+s.Retention.String(), "IDEMQ_TASK_RETENTION=1s",
		"IDEMQ_TASK_MAX_RETRY="+strconv.Itoa(maxRetry), "IDEMQ_BUSY_BUDGET="+busy.String())
	if s.Lease > 0 {
		env = append(env, "IDEMQ_LEASE="+s.Lease.String())
	}
	return env, maxRetry, nil
}

// RunSoak runs soak mode with opt.Binary's worker: the maximum (unless
// opt.Soak.MaxRate), then opt.Soak.Minutes of load, each minute's row printed to rows as
// it is sampled; progress lines go to progress. After an error the report holds the
// minutes sampled so far.
func RunSoak(ctx context.Context, opt Options, rows, progress io.Writer) (*SoakReport, error) {
	opt.defaults()
	s := &opt.Soak
	s.defaults()
	if opt.Binary == "" {
		return nil, errors.New("bench: soak mode runs idemq worker: no idemq binary (Options.Binary, -idemq)")
	}
	w, ok := drainWorkloads[s.Workload]
	if !ok || !slices.Contains(SoakWorkloadNames, s.Workload) {
		return nil, fmt.Errorf("bench: -soak-workload %q: one of %s", s.Workload, strings.Join(SoakWorkloadNames, ", "))
	}
	env, maxRetry, err := soakWorkerEnv(w, *s)
	if err != nil {
		return nil, err
	}
	w.workerEnv = env
	rep := &SoakReport{Revision: revision(), Options: *s, Binary: opt.Binary, WorkerEnv: env, Latency: soakLatency, Doubled: -1,
		PostgresSettings: append([]string{"shared_buffers=128MB"}, soakPostgresSettings...),
		WarmupMinutes:    int(math.Ceil(s.Retention.Minutes()))}
	opt.binaryMigrates = true
	e, err := setup(ctx, opt)
	if err != nil {
		return nil, err
	}
	defer e.close()
	rep.Statements = e.enableStatements(ctx)
	if !rep.Statements {
		fmt.Fprintln(progress, "soak: pg_stat_statements cannot be read (not in shared_preload_libraries?): purge statement times come from idemq_purge_seconds alone")
	}

	// The worker must take the settings before a drain runs it (a drain would wait for it
	// to its time limit).
	worker, _, err := e.startSoakWorker(ctx, opt.Binary, env)
	if err != nil {
		return rep, err
	}
	worker.stop()
	rep.MaxPerSecond = s.MaxRate
	if rep.MaxPerSecond <= 0 {
		d, err := e.soakMax(ctx, opt, w, progress)
		if err != nil {
			return rep, err
		}
		rep.MaxDrain, rep.MaxPerSecond = &d, d.PerSecond
	}
	rep.Rate = s.RateFrac * rep.MaxPerSecond
	if err := e.resetSoak(ctx, rep.Statements); err != nil {
		return rep, err
	}
	worker, metricsURL, err := e.startSoakWorker(ctx, opt.Binary, env)
	if err != nil {
		return rep, err
	}
	defer worker.stop()

	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	prefix := "k" + randomHex(3)
	p := newSoakProducer(e.rdb, w, prefix, rep.Rate, s.Dup, maxRetry, s.Producers)
	locks := &lockCounts{}
	go e.sampleLocks(loadCtx, 2*time.Second, locks)
	writeSoakHeader(rows, rep)
	start := time.Now()
	done := p.start(loadCtx, start)
	defer func() {
		stopLoad()
		<-done
		rep.EnqueueErrors, rep.FirstEnqueueError = p.errors()
		if rep.Verdicts == nil && len(rep.Minutes) > 0 {
			rep.Verdicts = evaluateSoak(rep) // on the minutes sampled before the stop
		}
	}()
	last := soakMark{}
	until := func(at time.Time) error {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-worker.exited:
			return fmt.Errorf("bench: the worker exited during the soak: %s", worker.stderr)
		case <-time.After(time.Until(at)):
			return nil
		}
	}
	for m := 1; m <= s.Minutes; m++ {
		sp := soakSpan{minute: m, from: start.Add(time.Duration(m-1) * time.Minute), to: start.Add(time.Duration(m) * time.Minute),
			prefix: prefix, metricsURL: metricsURL, statements: rep.Statements}
		if err := until(sp.to); err != nil {
			return rep, err
		}
		row, err := e.soakSample(ctx, sp, p, locks, &last)
		if err != nil {
			return rep, err
		}
		if err := until(sp.to.Add(soakSettle)); err != nil {
			return rep, err
		}
		if err := e.soakEffects(ctx, sp, &row); err != nil {
			return rep, err
		}
		rep.Minutes = append(rep.Minutes, row)
		writeSoakMinute(rows, row)
	}
	stopLoad()
	<-done
	if err := e.admin.QueryRow(ctx, soakDoubledSQL, prefix+"-%").Scan(&rep.Doubled); err != nil {
		return rep, fmt.Errorf("bench: count doubled effects: %w", err)
	}
	rep.Verdicts = evaluateSoak(rep)
	return rep, nil
}

// mainSoak runs soak mode, prints the minute table as it goes and the verdicts at the
// end, and writes the report to jsonPath when set, also after a failed or interrupted run
// (with the minutes sampled until then, judged). A failed target is an error too.
func mainSoak(ctx context.Context, opt Options, jsonPath string, stdout, stderr io.Writer) error {
	rep, err := RunSoak(ctx, opt, stdout, stderr)
	if rep == nil {
		return err
	}
	if len(rep.Verdicts) > 0 {
		writeSoakVerdicts(stdout, rep)
	}
	errs := []error{err}
	if jsonPath != "" {
		errs = append(errs, writeJSON(jsonPath, rep))
	}
	if f := rep.failed(); err == nil && len(f) > 0 {
		errs = append(errs, fmt.Errorf("bench: soak: %d of %d targets failed", len(f), len(rep.Verdicts)))
	}
	return errors.Join(errs...)
}

// soakMax measures the worker's maximum on w: a drain of 1,000 keys sizes a second one
// to take about MaxSeconds, whose rate is the maximum.
func (e *env) soakMax(ctx context.Context, opt Options, w drainWorkload, progress io.Writer) (DrainSample, error) {
	cfg := drainConfig{name: "worker×1", binary: opt.Binary, replicas: 1}
	opt.DrainTimeout = max(2*time.Minute, time.Duration(3*opt.Soak.MaxSeconds*float64(time.Second)))
	conc := server.DefaultConcurrency
	keys := 1000
	var d DrainSample
	for rep := range 2 {
		var err error
		if d, err = e.drain(ctx, opt, w, keys, conc, cfg, rep); err != nil {
			return d, err
		}
		fmt.Fprintf(progress, "soak: maximum, drain %d of %s: %d keys in %.1f s = %.0f/s\n", rep+1, w.name, d.Keys, d.Seconds, d.PerSecond)
		keys = min(max(int(d.PerSecond*opt.Soak.MaxSeconds), 1000), 2_000_000)
	}
	return d, nil
}

// startSoakWorker starts binary's worker with env, its metrics on a free loopback
// address, and waits until it is ready.
func (e *env) startSoakWorker(ctx context.Context, binary string, env []string) (*service, string, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, "", err
	}
	full := append(os.Environ(), "REDIS_URL="+e.redisDB.URL, "DATABASE_URL="+e.dsn, "IDEMQ_FAKEPAY_URL="+e.fakepay.URL, "IDEMQ_METRICS_ADDR="+addr)
	sv, err := startService(ctx, binary, "worker", "http://"+addr+"/readyz", append(full, env...))
	if err != nil {
		return nil, "", err
	}
	return sv, "http://" + addr + "/metrics", nil
}
