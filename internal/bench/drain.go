package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/idemq/idemq/tasks"
)

// Drain mode measures the binaries users run: `idemq worker` processes (1 and 3
// replicas, their defaults but IDEMQ_CONCURRENCY) against bare asynq in a process of its
// own (idemq-bench -bare-child: default asynq.Config but Concurrency, a default pgx pool, each
// debit's INSERT in its own transaction, each charge the same HTTP call to the provider),
// on the same tasks from a plain asynq client (no TaskID, no idemq header), paired per
// repetition. Checkouts (order:checkout) run handlers.Charger.Checkout's three recorded
// steps in the worker and unguarded.Checkout's same three effects, unrecorded, in bare
// asynq.

// Drain mode's configurations are bare asynq and, for each worker binary, 1 and 3
// replicas of it ("worker×1", or "worker×1 NAME" when several binaries are compared).
const (
	DrainBare     = "bare"
	bareChildFlag = "-bare-child"
)

// DrainRiver is drain mode's River configuration (Options.DrainRiver): the same debits
// drained by riverdrain (internal/bench/river, a module of its own), whose worker writes
// the wallet entry and completes its job in one transaction (river.JobCompleteTx).
const DrainRiver = "river"

// riverAccounts are the workloads River drains, with their accounts (0: one per debit).
// River has no scope locks: its debits over 13 accounts run side by side.
var riverAccounts = map[string]int{"debit-distinct": 0, "debit-hot": 13}

// drainConfig is one configuration of drain mode.
type drainConfig struct {
	name     string
	binary   string // "" for bare asynq; riverdrain's for River
	replicas int
}

// drainConfigs are the configurations of workload w.
func drainConfigs(opt Options, w drainWorkload) []drainConfig {
	cs := []drainConfig{{name: DrainBare}}
	if _, ok := riverAccounts[w.name]; ok && opt.DrainRiver != "" {
		cs = append(cs, drainConfig{name: DrainRiver, binary: opt.DrainRiver})
	}
	for _, r := range []int{1, 3} {
		for _, b := range opt.DrainBinaries {
			name := fmt.Sprintf("worker×%d", r)
			if len(opt.DrainBinaries) > 1 {
				name += " " + filepath.Base(b)
			}
			cs = append(cs, drainConfig{name: name, binary: b, replicas: r})
		}
	}
	return cs
}

// drainWorkload is a task type over a distribution of lock scopes.
type drainWorkload struct {
	name  string
	typ   string
	dup   int     // deliveries per key
	share float64 // of DrainN: hot scopes drain slowly
	scope func(rng *rand.Rand, i int) int
	// prefilled: the ledger holds Options.DrainPrefill completed rows of other keys
	// before each drain, as a ledger that keeps 30 days of keys does.
	prefilled bool
	// steps is how many steps each delivery records in the worker (idempotency.Step,
	// StepTx); bare asynq runs the same effects unrecorded. 0: none.
	steps int
	// leasedBase is a workload of leased one-effect jobs whose cost over bare asynq the
	// step table subtracts, to leave the steps' own ("" for none).
	leasedBase string
	// workerEnv is set in the worker binaries' environment (bare asynq runs as always).
	workerEnv []string
}

var drainWorkloads = map[string]drainWorkload{
	"debit-distinct": {name: "debit-distinct", typ: tasks.TypeDebit, dup: 1, share: 1, scope: func(_ *rand.Rand, i int) int { return i }},
	// debit-sql is debit-distinct through server.HandleSQLTx (database/sql over pgx's
	// stdlib): its ratio to debit-distinct, in the same run, is the SQL path's cost.
	"debit-sql":       {name: "debit-sql", typ: tasks.TypeDebit, dup: 1, share: 1, scope: func(_ *rand.Rand, i int) int { return i }, workerEnv: []string{"IDEMQ_DEBIT_DRIVER=sql"}},
	"debit-hot":       {name: "debit-hot", typ: tasks.TypeDebit, dup: 1, share: 0.25, scope: func(_ *rand.Rand, i int) int { return i % 13 }},
	"debit-zipf":      {name: "debit-zipf", typ: tasks.TypeDebit, dup: 1, share: 0.25, scope: zipf(1000)},
	"debit-dup":       {name: "debit-dup", typ: tasks.TypeDebit, dup: 3, share: 1.0 / 3, scope: func(_ *rand.Rand, i int) int { return i }},
	"debit-prefilled": {name: "debit-prefilled", typ: tasks.TypeDebit, dup: 1, share: 1, scope: func(_ *rand.Rand, i int) int { return i }, prefilled: true},
	"charge-distinct": {name: "charge-distinct", typ: tasks.TypeCharge, dup: 1, share: 0.5, scope: func(_ *rand.Rand, i int) int { return i }},
	"charge-hot":      {name: "charge-hot", typ: tasks.TypeCharge, dup: 1, share: 0.25, scope: func(_ *rand.Rand, i int) int { return i % 17 }},
	"checkout-distinct": {name: "checkout-distinct", typ: tasks.TypeCheckout, dup: 1, share: 0.25, scope: func(_ *rand.Rand, i int) int { return i },
		steps: len(tasks.CheckoutSteps), leasedBase: "charge-distinct"},
}

// DrainWorkloadNames lists drain mode's workloads, in the order a run measures them.
var DrainWorkloadNames = []string{"debit-distinct", "debit-sql", "debit-hot", "debit-zipf", "debit-dup", "debit-prefilled", "charge-distinct", "charge-hot", "checkout-distinct"}

// zipf draws scopes from a Zipf(s = 1.1) distribution over n scopes.
func zipf(n uint64) func(*rand.Rand, int) int {
	return func(rng *rand.Rand, _ int) int {
		return int(zipfTable(n).draw(rng.Float64())) // inverse transform, the CDF cached per n
	}
}

type zipfCDF []float64

var zipfCache sync.Map

func zipfTable(n uint64) zipfCDF {
	if v, ok := zipfCache.Load(n); ok {
		return v.(zipfCDF)
	}
	cdf := make(zipfCDF, n)
	sum := 0.0
	for k := range n {
		sum += 1 / math.Pow(float64(k+1), 1.1)
		cdf[k] = sum
	}
	for k := range cdf {
		cdf[k] /= sum
	}
	zipfCache.Store(n, cdf)
	return cdf
}

func (c zipfCDF) draw(u float64) uint64 { return uint64(sort.SearchFloat64s(c, u)) }

// payload returns task i's payload of w under prefix.
func (w drainWorkload) payload(prefix string, rng *rand.Rand, i int) []byte {
	s := strconv.Itoa(w.scope(rng, i))
	var v any
	switch w.typ {
	case tasks.TypeDebit:
		v = tasks.Debit{AccountID: "acct-" + s, AmountCents: 1, Reference: prefix + "-" + strconv.Itoa(i)}
	case tasks.TypeCheckout:
		v = tasks.Checkout{OrderID: prefix + "-" + strconv.Itoa(i), CustomerID: "cust-" + s, AmountCents: 100, Currency: "EUR",
			Email: "cust-" + s + "@example.com"}
	default:
		v = tasks.Charge{OrderID: prefix + "-" + strconv.Itoa(i), CustomerID: "cust-" + s, AmountCents: 100, Currency: "EUR"}
	}
	b, _ := json.Marshal(v)
	return b
}

// DrainSample is one drain of one configuration.
type DrainSample struct {
	Workload    string  `json:"workload"`
	Prefilled   int     `json:"prefilled_rows,omitempty"` // completed rows in the ledger before the drain
	Concurrency int     `json:"concurrency"`
	Config      string  `json:"config"`
	Rep         int     `json:"rep"`
	Keys        int     `json:"keys"`
	Deliveries  int     `json:"deliveries"`
	Seconds     float64 `json:"seconds"`
	PerSecond   float64 `json:"deliveries_per_second"`
	// InFlightMS is the mean time a delivery held one of the drain's slots (replicas ×
	// concurrency), in milliseconds: slots ÷ deliveries per second, by Little's law, as
	// every slot is busy while a backlog drains.
	InFlightMS float64 `json:"ms_in_flight"`
	// Effects are the rows of the workload's first effect (the wallet entry or the
	// provider's charge); every effect table is checked.
	Effects int `json:"effects"`
	// StepRows are the step records (processed_job_steps) of the drain's keys.
	StepRows int `json:"step_rows,omitempty"`
	// CPU per delivery, microseconds: the worker processes, redis-server, Postgres.
	CPUWorkers float64 `json:"cpu_us_workers"`
	CPURedis   float64 `json:"cpu_us_redis"`
	CPUPG      float64 `json:"cpu_us_pg"`
	// WAL Postgres wrote per delivery, bytes (the whole cluster's: meaningful with
	// -private-postgres).
	WALBytes float64 `json:"wal_bytes"`
	// Worker only, from its /metrics: busy answers (lock and ledger) per delivery and
	// ledger requests per shared commit.
	BusyPerDelivery float64 `json:"busy_per_delivery"`
	// Ledger claims (new and taken over) per delivery, DoTx deliveries run again alone
	// (their shared transaction rolled back, or gave their claim back past its budget),
	// and scope locks handed over in a process, per delivery.
	ClaimsPerDelivery float64 `json:"claims_per_delivery"`
	RerunsPerDelivery float64 `json:"reruns_per_delivery"`
	HandedPerDelivery float64 `json:"handed_per_delivery"`
	PerCommit         float64 `json:"requests_per_commit"`
	Archived          int     `json:"archived"`
}

// RunDrain runs drain mode: for each workload and concurrency, reps repetitions of every
// configuration (the order rotated each repetition), each draining the same tasks.
func RunDrain(ctx context.Context, opt Options, progress io.Writer) ([]DrainSample, error) {
	opt.defaults()
	if len(opt.DrainBinaries) == 0 {
		return nil, errors.New("bench: drain mode runs idemq worker: no idemq binary (Options.Binary, -idemq)")
	}
	e, err := setup(ctx, opt)
	if err != nil {
		return nil, err
	}
	defer e.close()
	var out []DrainSample
	for _, wn := range opt.DrainWorkloads {
		w, ok := drainWorkloads[wn]
		if !ok {
			return out, fmt.Errorf("bench: unknown drain workload %q (one of %s)", wn, strings.Join(DrainWorkloadNames, ", "))
		}
		configs := drainConfigs(opt, w)
		keys := max(int(float64(opt.DrainN)*w.share), 100)
		for _, conc := range opt.DrainConcurrency {
			for rep := range opt.Reps {
				order := slices.Clone(configs)
				for range rep % len(order) {
					order = append(order[1:], order[0])
				}
				for _, cfg := range order {
					drain := e.drain
					if cfg.name == DrainRiver {
						drain = e.drainRiver
					}
					s, err := drain(ctx, opt, w, keys, conc, cfg, rep)
					if err != nil {
						return out, err
					}
					fmt.Fprintf(progress, "drain %-17s c=%-3d %-20s rep %d: %6d deliveries in %6.2fs = %7.0f/s, %.1f ms in flight, effects %d, CPU µs %0.f+%0.f+%0.f, WAL %0.f B, busy/delivery %.2f, per commit %.1f, claims/delivery %.2f, reruns/delivery %.2f, handed/delivery %.2f\n",
						w.name, conc, cfg.name, rep+1, s.Deliveries, s.Seconds, s.PerSecond, s.InFlightMS, s.Effects, s.CPUWorkers, s.CPURedis, s.CPUPG, s.WALBytes, s.BusyPerDelivery, s.PerCommit,
						s.ClaimsPerDelivery, s.RerunsPerDelivery, s.HandedPerDelivery)
					out = append(out, s)
				}
			}
		}
	}
	return out, nil
}

// drain measures one configuration on one workload.
func (e *env) drain(ctx context.Context, opt Options, w drainWorkload, keys, conc int, cfg drainConfig, rep int) (DrainSample, error) {
	config := cfg.name
	s := DrainSample{Workload: w.name, Concurrency: conc, Config: config, Rep: rep + 1, Keys: keys, Deliveries: keys * w.dup}
	reset := e.reset
	if w.prefilled {
		s.Prefilled = opt.DrainPrefill
		reset = func(ctx context.Context) error { return e.resetPrefilled(ctx, opt.DrainPrefill) }
	}
	if err := reset(ctx); err != nil {
		return s, err
	}
	prefix := fmt.Sprintf("d%d%s", rep, randomHex(3))
	if err := e.enqueuePlain(ctx, w, prefix, keys, uint64(rep)); err != nil {
		return s, err
	}
	env := append(os.Environ(), "REDIS_URL="+e.redisDB.URL, "DATABASE_URL="+e.dsn, "IDEMQ_FAKEPAY_URL="+e.fakepay.URL)
	var procs []*exec.Cmd
	var metricsURLs []string
	start := func(binary string, args []string, extra ...string) error {
		cmd := exec.CommandContext(ctx, binary, args...)
		cmd.Env = append(slices.Clone(env), extra...)
		cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
		if err := cmd.Start(); err != nil {
			return fmt.Errorf("bench: start %s: %w", binary, err)
		}
		procs = append(procs, cmd)
		return nil
	}
	defer func() {
		for _, p := range procs {
			p.Process.Signal(syscall.SIGTERM)
		}
		for _, p := range procs {
			p.Wait()
		}
	}()
	wal0 := e.walLSN(ctx)
	cpu0 := e.probe.snap(ctx)
	switch cfg.binary {
	case "":
		if err := start(opt.Self, []string{bareChildFlag, "-concurrency", strconv.Itoa(conc), "-fakepay", e.fakepay.URL}, ChildEnv+"=1"); err != nil {
			return s, err
		}
	default:
		for range cfg.replicas {
			addr, err := freeAddr()
			if err != nil {
				return s, err
			}
			metricsURLs = append(metricsURLs, "http://"+addr+"/metrics")
			extra := append([]string{"IDEMQ_CONCURRENCY=" + strconv.Itoa(conc), "IDEMQ_METRICS_ADDR=" + addr, "IDEMQ_LOG_LEVEL=error"}, w.workerEnv...)
			if err := start(cfg.binary, []string{"worker"}, extra...); err != nil {
				return s, err
			}
		}
	}
	childCPU0 := childCPU(procs)
	insp := asynq.NewInspectorFromRedisClient(e.rdb)
	var began, ended time.Time
	deadline := time.Now().Add(opt.DrainTimeout)
	for {
		q, err := insp.GetQueueInfo(tasks.Queue)
		if err == nil {
			left := q.Pending + q.Active + q.Scheduled + q.Retry
			if began.IsZero() && left < s.Deliveries {
				began = time.Now()
			}
			if left == 0 {
				ended, s.Archived = time.Now(), q.Archived
				break
			}
		}
		if time.Now().After(deadline) {
			return s, fmt.Errorf("bench: drain %s %s c=%d did not finish within %s", w.name, config, conc, opt.DrainTimeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cpu1 := e.probe.snap(ctx)
	childCPU1 := childCPU(procs)
	wal1 := e.walLSN(ctx)
	s.Seconds = ended.Sub(began).Seconds()
	s.PerSecond = float64(s.Deliveries) / s.Seconds
	s.InFlightMS = float64(conc*max(cfg.replicas, 1)) / s.PerSecond * 1000
	d := cpu0.to(cpu1)
	per := 1e6 / float64(s.Deliveries)
	s.CPUWorkers, s.CPURedis, s.CPUPG = (childCPU1-childCPU0)*per, d.redis*per, d.pg*per
	if wal0 != "" && wal1 != "" {
		var bytes float64
		if err := e.admin.QueryRow(ctx, `SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::float8`, wal1, wal0).Scan(&bytes); err == nil {
			s.WALBytes = bytes / float64(s.Deliveries)
		}
	}
	var busy, commits, requests, claims, reruns, handed float64
	for _, u := range metricsURLs {
		m := scrape(ctx, u)
		busy += events(m, "idemq_lock_events_total", "busy") + events(m, "idemq_ledger_events_total", "busy")
		claims += events(m, "idemq_ledger_events_total", "claimed", "takeover")
		reruns += events(m, "idemq_ledger_events_total", "shared_rerun", "given_back")
		handed += events(m, "idemq_lock_events_total", "handed")
		sum, count := histogram(m, "idemq_ledger_commit_requests")
		requests, commits = requests+sum, commits+count
	}
	s.BusyPerDelivery = busy / float64(s.Deliveries)
	s.ClaimsPerDelivery, s.RerunsPerDelivery, s.HandedPerDelivery = claims/float64(s.Deliveries), reruns/float64(s.Deliveries), handed/float64(s.Deliveries)
	if commits > 0 {
		s.PerCommit = requests / commits
	}
	want := keys
	if cfg.binary == "" && w.typ == tasks.TypeDebit {
		want = s.Deliveries // bare asynq runs every delivery
	}
	for i, t := range effectTables[w.typ] {
		var n int
		if err := e.admin.QueryRow(ctx, `SELECT count(*) FROM `+t.table+` WHERE `+t.column+` LIKE $1`, prefix+"-%").Scan(&n); err != nil {
			return s, fmt.Errorf("bench: count effects: %w", err)
		}
		if i == 0 {
			s.Effects = n
		}
		if n != want || s.Archived != 0 {
			return s, fmt.Errorf("bench: drain %s %s c=%d: %d rows in %s (want %d), %d archived", w.name, config, conc, n, t.table, want, s.Archived)
		}
	}
	if w.steps > 0 {
		if err := e.admin.QueryRow(ctx, `SELECT count(*) FROM processed_job_steps WHERE idempotency_key LIKE $1`, "%:"+prefix+"-%").Scan(&s.StepRows); err != nil {
			return s, fmt.Errorf("bench: count step records: %w", err)
		}
		want := keys * w.steps
		if cfg.binary == "" {
			want = 0 // bare asynq records no step
		}
		if s.StepRows != want {
			return s, fmt.Errorf("bench: drain %s %s c=%d: %d step records (want %d)", w.name, config, conc, s.StepRows, want)
		}
	}
	return s, nil
}

// effectTables are where each task type's effects land, one row per key and effect: the
// table and its column holding the task's reference or order id.
var effectTables = map[string][]struct{ table, column string }{
	tasks.TypeDebit:    {{"wallet_entries", "reference"}},
	tasks.TypeCharge:   {{"fakepay_charges", "order_id"}},
	tasks.TypeCheckout: {{"fakepay_charges", "order_id"}, {"orders", "order_id"}, {"fakepay_emails", "order_id"}},
}

// walLSN is Postgres's current WAL position ("" when it cannot be read).
func (e *env) walLSN(ctx context.Context) string {
	var lsn string
	if err := e.admin.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn); err != nil {
		return ""
	}
	return lsn
}

// Prefilled rows are the keys of debits completed over the last 29 days, in the shape
// the worker writes them, their keys scattered over the key space as real references are.
const (
	prefillSQL = `
INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, result, attempts,
                            created_at, updated_at, started_at, completed_at)
SELECT 'debit:' || md5(g::text), 'wallet:debit', 'completed', nextval('processed_jobs_fence_seq'),
       gen_random_uuid(), '{"balance_cents": -1}', 1, t, t, t, t
FROM generate_series($1::bigint, $2::bigint) g,
     LATERAL (SELECT now() - interval '29 days' * (1 - g::float8 / $3::bigint) - interval '1 hour' AS t) at`
	// drainRowsSQL deletes what a drain wrote to the ledger, its rows and their step
	// records, which are all newer than the prefilled rows.
	drainRowsSQL = `
WITH steps AS (DELETE FROM processed_job_steps WHERE created_at > now() - interval '30 minutes')
DELETE FROM processed_jobs WHERE started_at > now() - interval '30 minutes'`
)

// resetPrefilled empties Redis and every table but the ledger, deletes the rows of the
// last drain from it, and fills it up to n rows (the first time, in chunks of a million).
func (e *env) resetPrefilled(ctx context.Context, n int) error {
	if err := e.resetKeepingLedger(ctx); err != nil {
		return err
	}
	if _, err := e.admin.Exec(ctx, drainRowsSQL); err != nil {
		return fmt.Errorf("bench: delete the last drain's rows: %w", err)
	}
	var have int
	if err := e.admin.QueryRow(ctx, `SELECT count(*) FROM processed_jobs`).Scan(&have); err != nil {
		return fmt.Errorf("bench: count the ledger: %w", err)
	}
	if have == n {
		return nil
	}
	if _, err := e.admin.Exec(ctx, `TRUNCATE processed_jobs, processed_job_steps`); err != nil {
		return fmt.Errorf("bench: truncate: %w", err)
	}
	const chunk = 1_000_000
	for from := 1; from <= n; from += chunk {
		if _, err := e.admin.Exec(ctx, prefillSQL, from, min(from+chunk-1, n), n); err != nil {
			return fmt.Errorf("bench: prefill the ledger: %w", err)
		}
	}
	if _, err := e.admin.Exec(ctx, `VACUUM ANALYZE processed_jobs`); err != nil {
		return fmt.Errorf("bench: vacuum the ledger: %w", err)
	}
	return nil
}

// enqueuePlain publishes keys tasks of w (each w.dup times) as a plain asynq producer
// does: asynq.NewTask and Enqueue, no TaskID, no idemq header.
func (e *env) enqueuePlain(ctx context.Context, w drainWorkload, prefix string, keys int, seed uint64) error {
	client := asynq.NewClientFromRedisClient(e.rdb)
	rng := rand.New(rand.NewPCG(seed, 7))
	payloads := make([][]byte, 0, keys*w.dup)
	for i := range keys {
		p := w.payload(prefix, rng, i)
		for range w.dup {
			payloads = append(payloads, p)
		}
	}
	rand.New(rand.NewPCG(seed, 11)).Shuffle(len(payloads), func(i, j int) { payloads[i], payloads[j] = payloads[j], payloads[i] })
	return inParallel(ctx, 0, len(payloads), func(i int) error {
		if _, err := client.EnqueueContext(ctx, asynq.NewTask(w.typ, payloads[i]), asynq.Queue(tasks.Queue)); err != nil {
			return fmt.Errorf("bench: enqueue: %w", err)
		}
		return nil
	})
}

func childCPU(procs []*exec.Cmd) float64 {
	var t float64
	for _, p := range procs {
		v, _ := procCPU(p.Process.Pid)
		t += v
	}
	return t
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// scrape reads a worker's /metrics page (nil when it cannot).
func scrape(ctx context.Context, url string) map[string]*dto.MetricFamily {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil
	}
	return fams
}

// events sums the counter name over the series whose event label is one of events.
func events(fams map[string]*dto.MetricFamily, name string, events ...string) float64 {
	var n float64
	for _, m := range fams[name].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "event" && slices.Contains(events, l.GetValue()) {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}

// histogram sums the histogram name's observations and their count over its series.
func histogram(fams map[string]*dto.MetricFamily, name string) (sum, count float64) {
	for _, m := range fams[name].GetMetric() {
		sum += m.GetHistogram().GetSampleSum()
		count += float64(m.GetHistogram().GetSampleCount())
	}
	return sum, count
}

// WriteDrainTable prints drain mode's table: per workload, concurrency and configuration
// the median deliveries per second (min–max), the median of the per-repetition ratios to
// bare asynq (and to River, when River ran), CPU per delivery by process, busy answers
// per delivery, requests per shared commit and the mean time in flight per delivery.
// When a workload of recorded steps ran, a second table follows: per worker configuration
// its CPU per delivery less bare asynq's on the same effects, per step, and, when the
// workload's leased one-effect base ran too, less that base's own cost over bare asynq.
func WriteDrainTable(w io.Writer, samples []DrainSample) error {
	type group struct {
		workload string
		conc     int
		config   string
	}
	by := map[group][]DrainSample{}
	var order []group
	hasRiver := false
	for _, s := range samples {
		g := group{s.Workload, s.Concurrency, s.Config}
		if _, ok := by[g]; !ok {
			order = append(order, g)
		}
		by[g] = append(by[g], s)
		hasRiver = hasRiver || s.Config == DrainRiver
	}
	// paired formats the median (min–max) of the ratios of ss's rates to base's of the
	// same repetition.
	paired := func(ss, base []DrainSample) string {
		var ratios []float64
		for _, s := range ss {
			for _, b := range base {
				if b.Rep == s.Rep {
					ratios = append(ratios, s.PerSecond/b.PerSecond)
				}
			}
		}
		if len(ratios) == 0 {
			return "-"
		}
		return fmt.Sprintf("**%.2f** (%.2f–%.2f)", median(ratios), slices.Min(ratios), slices.Max(ratios))
	}
	sort.SliceStable(order, func(i, j int) bool {
		a, b := order[i], order[j]
		if a.workload != b.workload {
			return slices.Index(DrainWorkloadNames, a.workload) < slices.Index(DrainWorkloadNames, b.workload)
		}
		if a.conc != b.conc {
			return a.conc < b.conc
		}
		return configBefore(a.config, b.config)
	})
	riverHead, riverAlign := "", ""
	if hasRiver {
		riverHead, riverAlign = " ÷ River (paired) |", "--:|"
	}
	fmt.Fprintln(w, "| workload | concurrency | configuration | deliveries | deliveries/s | ÷ bare (paired) |"+riverHead+" CPU µs/delivery: workers + Redis + PG | CPU ÷ bare's: workers / Redis / PG | WAL B/delivery | busy per delivery | requests per commit | ms in flight (slots ÷ rate) |")
	fmt.Fprintln(w, "|---|--:|---|--:|--:|--:|"+riverAlign+"--:|--:|--:|--:|--:|--:|")
	for _, g := range order {
		ss := by[g]
		rates := collect(ss, func(s DrainSample) float64 { return s.PerSecond })
		cw, cr, cp := median(collect(ss, func(s DrainSample) float64 { return s.CPUWorkers })),
			median(collect(ss, func(s DrainSample) float64 { return s.CPURedis })),
			median(collect(ss, func(s DrainSample) float64 { return s.CPUPG }))
		ratio := "1"
		if g.config != DrainBare {
			ratio = paired(ss, by[group{g.workload, g.conc, DrainBare}])
		}
		if hasRiver {
			river := "1"
			if g.config != DrainRiver {
				river = paired(ss, by[group{g.workload, g.conc, DrainRiver}])
			}
			ratio += " | " + river
		}
		busy, commit := "-", "-"
		if g.config != DrainBare && g.config != DrainRiver {
			busy = fmt.Sprintf("%.2f", median(collect(ss, func(s DrainSample) float64 { return s.BusyPerDelivery })))
			commit = fmt.Sprintf("%.1f", median(collect(ss, func(s DrainSample) float64 { return s.PerCommit })))
		}
		cpuRatio := "-"
		if bare := by[group{g.workload, g.conc, DrainBare}]; g.config != DrainBare && len(bare) > 0 {
			bw, br, bp := median(collect(bare, func(s DrainSample) float64 { return s.CPUWorkers })),
				median(collect(bare, func(s DrainSample) float64 { return s.CPURedis })),
				median(collect(bare, func(s DrainSample) float64 { return s.CPUPG }))
			cpuRatio = fmt.Sprintf("%.2f / %.2f / %.2f", cw/bw, cr/br, cp/bp)
		}
		wal := median(collect(ss, func(s DrainSample) float64 { return s.WALBytes }))
		fmt.Fprintf(w, "| %s | %d | %s | %d | %.0f (%.0f–%.0f) | %s | %.0f + %.0f + %.0f = %.0f | %s | %.0f | %s | %s | %.1f |\n",
			g.workload, g.conc, g.config, ss[0].Deliveries, median(rates), slices.Min(rates), slices.Max(rates), ratio,
			cw, cr, cp, cw+cr+cp, cpuRatio, wal, busy, commit, median(collect(ss, func(s DrainSample) float64 { return s.InFlightMS })))
	}
	var stepped []group
	for _, g := range order {
		if drainWorkloads[g.workload].steps > 0 && g.config != DrainBare && g.config != DrainRiver {
			stepped = append(stepped, g)
		}
	}
	if len(stepped) == 0 {
		return nil
	}
	cpuOf := func(g group) (cpu [3]float64, ok bool) {
		ss := by[g]
		if len(ss) == 0 {
			return cpu, false
		}
		return [3]float64{median(collect(ss, func(s DrainSample) float64 { return s.CPUWorkers })),
			median(collect(ss, func(s DrainSample) float64 { return s.CPURedis })),
			median(collect(ss, func(s DrainSample) float64 { return s.CPUPG }))}, true
	}
	inFlight := func(g group) float64 {
		return median(collect(by[g], func(s DrainSample) float64 { return s.InFlightMS }))
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Step records: CPU µs per delivery, the configuration's median less bare asynq's (the same effects, unrecorded), then ÷ the steps a delivery records; the last column also takes off what a leased one-effect job costs over bare asynq (the same configuration less bare asynq on the base workload), when that workload ran at this concurrency.")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| workload | concurrency | configuration | ÷ bare (paired) | ms in flight: idemq / bare | idemq − bare: workers / Redis / PG | (idemq − bare) ÷ steps: workers / Redis / PG = total | less the base's idemq − bare, ÷ steps: workers / Redis / PG = total |")
	fmt.Fprintln(w, "|---|--:|---|--:|--:|--:|--:|--:|")
	for _, g := range stepped {
		wl := drainWorkloads[g.workload]
		bare := group{g.workload, g.conc, DrainBare}
		idemq, ok1 := cpuOf(g)
		base, ok2 := cpuOf(bare)
		if !ok1 || !ok2 {
			continue
		}
		n := float64(wl.steps)
		var diff, per [3]float64
		for i := range diff {
			diff[i] = idemq[i] - base[i]
			per[i] = diff[i] / n
		}
		beyond := "-"
		if lc, ok := cpuOf(group{wl.leasedBase, g.conc, g.config}); ok {
			if lb, ok := cpuOf(group{wl.leasedBase, g.conc, DrainBare}); ok {
				var b [3]float64
				for i := range b {
					b[i] = (diff[i] - (lc[i] - lb[i])) / n
				}
				beyond = fmt.Sprintf("%.0f / %.0f / %.0f = %.0f (base %s)", b[0], b[1], b[2], b[0]+b[1]+b[2], wl.leasedBase)
			}
		}
		fmt.Fprintf(w, "| %s | %d | %s | %s | %.1f / %.1f | %.0f / %.0f / %.0f | %.0f / %.0f / %.0f = %.0f | %s |\n",
			g.workload, g.conc, g.config, paired(by[g], by[bare]), inFlight(g), inFlight(bare),
			diff[0], diff[1], diff[2], per[0], per[1], per[2], per[0]+per[1]+per[2], beyond)
	}
	return nil
}

// configBefore orders configurations: bare asynq first, then by name (worker×1 … before
// worker×3 …).
func configBefore(a, b string) bool {
	if a == DrainBare || b == DrainBare {
		return a == DrainBare && b != DrainBare
	}
	return a < b
}

func collect(ss []DrainSample, f func(DrainSample) float64) []float64 {
	out := make([]float64, len(ss))
	for i, s := range ss {
		out[i] = f(s)
	}
	return out
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(v))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
