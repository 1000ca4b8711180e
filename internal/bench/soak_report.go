package bench

import (
	"fmt"
	"io"
	"slices"
	"strings"
)

// The soak's targets (evaluateSoak).
const (
	soakWindow        = 5    // minutes compared at the start and at the end, at most
	soakThroughputMin = 0.95 // last window's completions ÷ the first's, at least
	soakP99Max        = 1.5  // last window's p99 ÷ the first's, at most
	soakSizeMax       = 1.2  // a table's size at the end ÷ at the end of the warm-up, at most
	soakSizeFloor     = 1 << 20
	soakPurgeMaxMS    = 1000 // a purge statement, at most
	// soakBacklogSeconds is the backlog, in seconds of enqueues, a steady load ends
	// with at most.
	soakBacklogSeconds = 10
)

// SoakReport is a soak's result, as -json writes it.
type SoakReport struct {
	Revision string      `json:"revision"`
	Options  SoakOptions `json:"options"`
	Binary   string      `json:"binary"`
	// WorkerEnv are the variables the worker ran with besides REDIS_URL, DATABASE_URL,
	// IDEMQ_FAKEPAY_URL and IDEMQ_METRICS_ADDR; everything else is its default.
	WorkerEnv []string `json:"worker_env"`
	// PostgresSettings are the private server's settings over Postgres's defaults.
	PostgresSettings []string `json:"postgres_settings"`
	// Statements says whether pg_stat_statements could be read (PurgeMaxMS).
	Statements bool `json:"pg_stat_statements"`
	// MaxPerSecond is the worker's maximum on the workload: MaxDrain's rate, or
	// SoakOptions.MaxRate.
	MaxPerSecond float64      `json:"max_per_second"`
	MaxDrain     *DrainSample `json:"max_drain,omitempty"`
	// Rate is the enqueues per second asked of the producer (duplicates included).
	Rate float64 `json:"rate"`
	// WarmupMinutes are the minutes the targets leave out: the first retention period,
	// rounded up, during which the purge has nothing to delete.
	WarmupMinutes int          `json:"warmup_minutes"`
	Latency       string       `json:"latency"` // what P50ms, P99ms and MaxMS measure
	Minutes       []SoakMinute `json:"minutes"`
	// EnqueueErrors counts enqueues that failed; FirstEnqueueError is the first one's.
	EnqueueErrors     int64  `json:"enqueue_errors"`
	FirstEnqueueError string `json:"first_enqueue_error,omitempty"`
	// Doubled counts references with more than one wallet entry at the end (a debit that
	// took effect twice); -1 when the end was not reached.
	Doubled  int           `json:"doubled"`
	Verdicts []SoakVerdict `json:"verdicts"`
}

// SoakMinute is one minute of the load: counters over the minute, sizes and tuple counts
// at its end, and the completions and latency of the transactions that began within it,
// read 5 s after its end.
type SoakMinute struct {
	Minute     int   `json:"minute"`     // 1 is the load's first
	Enqueued   int64 `json:"enqueued"`   // tasks the producer enqueued, duplicates included
	Duplicates int64 `json:"duplicates"` // of which keys enqueued again
	// Behind counts the producer's slots due by the sample but not yet enqueued (nor
	// failed): it falling behind the rate asked.
	Behind int64 `json:"producer_behind"`
	// Completed counts the wallet entries whose transaction (the one that completed
	// their job in the ledger) began in the minute: the jobs completed in it.
	Completed int64 `json:"completed"`
	// Deliveries is asynq's processed count over the minute: every delivery, duplicates
	// and busy retries included.
	Deliveries int64 `json:"deliveries"`
	Backlog    int   `json:"backlog"`  // tasks pending, active, scheduled or to retry
	Archived   int   `json:"archived"` // tasks archived so far
	// Latency of the minute's completed jobs (SoakReport.Latency), ms.
	P50ms  float64     `json:"p50_ms"`
	P99ms  float64     `json:"p99_ms"`
	MaxMS  float64     `json:"max_ms"`
	Tables []SoakTable `json:"tables"`
	// PurgeRows are the rows the purge deleted in the minute, by table
	// (idemq_purge_rows_total), and PurgeBatches its batch statements
	// (idemq_purge_seconds' count).
	PurgeRows    map[string]float64 `json:"purge_rows"`
	PurgeBatches int64              `json:"purge_batches"`
	// PurgeSlowestLE is the upper bound of the histogram bucket of the minute's slowest
	// batch, seconds: 0 without a batch, -1 above the last bucket (10 s). PurgeOver1s
	// counts the minute's batches over 1 s.
	PurgeSlowestLE float64 `json:"purge_slowest_le_s"`
	PurgeOver1s    int64   `json:"purge_over_1s"`
	// PurgeMaxMS is the longest purge statement since the load began, by
	// pg_stat_statements' max_exec_time; -1 when it cannot be read.
	PurgeMaxMS float64 `json:"purge_max_ms"`
	// Lock waits, sampled every 2 s from pg_stat_activity: LockSamples samples, in which
	// HotLockWaits backends other than the purge were seen waiting for a lock,
	// HotWaitsOnPurge of them behind a purge statement, and PurgeLockWaits purge
	// statements were waiting.
	LockSamples     int `json:"lock_samples"`
	HotLockWaits    int `json:"hot_lock_waits"`
	HotWaitsOnPurge int `json:"hot_lock_waits_on_purge"`
	PurgeLockWaits  int `json:"purge_lock_waits"`
}

// SoakTable is a ledger table at a sample; a partitioned table's figures sum its
// partitions.
type SoakTable struct {
	Name       string `json:"name"`
	Partitions int    `json:"partitions,omitempty"` // 0: not partitioned
	// TotalBytes is pg_total_relation_size: the heap, TOAST and every index.
	TotalBytes int64 `json:"total_bytes"`
	IndexBytes int64 `json:"index_bytes"`
	// Indexes are each index's size (a partitioned index's partitions summed).
	Indexes      map[string]int64 `json:"indexes"`
	Live         int64            `json:"n_live_tup"`
	Dead         int64            `json:"n_dead_tup"`
	Autovacuums  int64            `json:"autovacuum_count"`
	Autoanalyzes int64            `json:"autoanalyze_count"`
}

// SoakVerdict is one target's outcome.
type SoakVerdict struct {
	Target string `json:"target"`
	Got    string `json:"got"`
	Result string `json:"result"` // PASS, FAIL, or SKIP when the soak was too short to tell
}

// soakTables are the tables a soak samples, in its table's order.
var soakTables = []string{"processed_jobs", "processed_job_events", "job_intents"}

// evaluateSoak judges r's minutes against the targets, its warm-up left out. The first
// window is the up to 5 minutes after the warm-up, the last window as many at the end
// (fewer when the soak is short: half of what follows the warm-up).
func evaluateSoak(r *SoakReport) []SoakVerdict {
	rows, warmup := r.Minutes, r.WarmupMinutes
	var out []SoakVerdict
	add := func(target string, pass bool, got string, args ...any) {
		r := "FAIL"
		if pass {
			r = "PASS"
		}
		out = append(out, SoakVerdict{Target: target, Got: fmt.Sprintf(got, args...), Result: r})
	}
	skip := func(target, why string) { out = append(out, SoakVerdict{Target: target, Got: why, Result: "SKIP"}) }
	window := min(soakWindow, (len(rows)-warmup)/2)
	thr := fmt.Sprintf("throughput: last %d min ≥ %.2f × the %d min after the warm-up", window, soakThroughputMin, window)
	p99 := fmt.Sprintf("p99: last %d min ≤ %.1f × the %d min after the warm-up", window, soakP99Max, window)
	if window < 1 {
		why := fmt.Sprintf("%d minutes sampled, %d of warm-up: none to compare", len(rows), warmup)
		skip("throughput: last minutes ≥ 0.95 × the first after the warm-up", why)
		skip("p99: last minutes ≤ 1.5 × the first after the warm-up", why)
	} else {
		first, last := rows[warmup:warmup+window], rows[len(rows)-window:]
		mean := func(ms []SoakMinute) float64 {
			var n int64
			for _, m := range ms {
				n += m.Completed
			}
			return float64(n) / float64(len(ms)) / 60
		}
		worst := func(ms []SoakMinute) float64 {
			return slices.Max(collectMinutes(ms, func(m SoakMinute) float64 { return m.P99ms }))
		}
		f, l := mean(first), mean(last)
		add(thr, f > 0 && l >= soakThroughputMin*f, "%.0f/s against %.0f/s (%s)", l, f, ratio(l, f))
		f, l = worst(first), worst(last)
		add(p99, f > 0 && l <= soakP99Max*f, "%.1f ms against %.1f ms (%s; each the window's worst minute)", l, f, ratio(l, f))
	}
	if warmup < 1 || len(rows) <= warmup {
		for _, t := range soakTables {
			skip(fmt.Sprintf("%s size: end ≤ %.1f × the end of the warm-up", t, soakSizeMax), fmt.Sprintf("%d minutes sampled, %d of warm-up", len(rows), warmup))
		}
	} else {
		base, end := rows[warmup-1], rows[len(rows)-1]
		for i, t := range soakTables {
			var b, e int64
			if i < len(base.Tables) && i < len(end.Tables) {
				b, e = base.Tables[i].TotalBytes, end.Tables[i].TotalBytes
			}
			small := b <= soakSizeFloor && e <= soakSizeFloor
			note := ratio(float64(e), float64(b))
			if small {
				note += "; both under 1 MiB"
			}
			add(fmt.Sprintf("%s size: end ≤ %.1f × the end of the warm-up (or both under 1 MiB)", t, soakSizeMax), float64(e) <= soakSizeMax*float64(b) || small,
				"%s at minute %d against %s at minute %d (%s)", bytesText(e), end.Minute, bytesText(b), base.Minute, note)
		}
	}
	var maxMS float64
	var over int64
	known := len(rows) > 0
	for _, m := range rows {
		maxMS, over = max(maxMS, m.PurgeMaxMS), over+m.PurgeOver1s
		known = known && m.PurgeMaxMS >= 0
	}
	got := fmt.Sprintf("%d batches over 1 s by idemq_purge_seconds", over)
	if known {
		got = fmt.Sprintf("longest %.1f ms by pg_stat_statements; ", maxMS) + got
	}
	add("purge: no statement over 1 s", maxMS <= soakPurgeMaxMS && over == 0, "%s", got)
	var hot, onPurge, samples int
	for _, m := range rows {
		hot, onPurge, samples = hot+m.HotLockWaits, onPurge+m.HotWaitsOnPurge, samples+m.LockSamples
	}
	add("lock waits: none on the hot path behind the purge", onPurge == 0,
		"%d hot-path lock waits seen in %d samples, %d of them behind a purge statement", hot, samples, onPurge)
	if r.Doubled < 0 {
		skip("exactly once: no debit took effect twice", "the soak did not reach its end")
	} else {
		add("exactly once: no debit took effect twice", r.Doubled == 0, "%d references with more than one wallet entry", r.Doubled)
	}
	// The targets above assume the worker keeps up with the load: a backlog that grows
	// measures the queue, not the worker.
	if len(rows) > 0 {
		end := rows[len(rows)-1]
		add(fmt.Sprintf("steady load: backlog at the end ≤ %d s of enqueues", soakBacklogSeconds), float64(end.Backlog) <= soakBacklogSeconds*r.Rate,
			"%d tasks at minute %d against %.0f (at %.0f/s; if it grows, the rate is over the worker's: lower -soak-rate-frac)",
			end.Backlog, end.Minute, soakBacklogSeconds*r.Rate, r.Rate)
	}
	return out
}

func collectMinutes(ms []SoakMinute, f func(SoakMinute) float64) []float64 {
	out := make([]float64, len(ms))
	for i, m := range ms {
		out[i] = f(m)
	}
	return out
}

func ratio(a, b float64) string {
	if b == 0 {
		return "× –"
	}
	return fmt.Sprintf("× %.2f", a/b)
}

// bytesText prints n bytes in kB below a MiB, else in MiB.
func bytesText(n int64) string {
	if n < 1<<20 {
		return fmt.Sprintf("%d kB", n/1024)
	}
	return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
}

// writeSoakHeader prints the soak's set-up and the minute table's head.
func writeSoakHeader(w io.Writer, r *SoakReport) {
	fmt.Fprintf(w, "soak: %s worker (%s), %s at %.0f enqueues/s (%.2f × the maximum %.0f/s, %.0f%% keys enqueued again) for %d minutes; warm-up: the first %d (the first retention period)\n",
		r.Options.Workload, strings.Join(r.WorkerEnv, " "), r.Binary, r.Rate, r.Options.RateFrac, r.MaxPerSecond, r.Options.Dup*100, r.Options.Minutes, r.WarmupMinutes)
	fmt.Fprintf(w, "latency: %s\n\n", r.Latency)
	head := "| min | enqueued/s | completed/s | deliveries/s | backlog | latency p50 / p99 / max ms |"
	align := "|--:|--:|--:|--:|--:|--:|"
	for _, t := range soakTables {
		head += " " + t + " (dead tuples) |"
		align += "--:|"
	}
	head += " autovacuums (each table) | purged rows | purge batches (slowest ≤) | purge max ms | lock waits: hot (behind purge) |"
	align += "--:|--:|--:|--:|--:|"
	fmt.Fprintln(w, head)
	fmt.Fprintln(w, align)
}

// writeSoakMinute prints one row of the minute table.
func writeSoakMinute(w io.Writer, m SoakMinute) {
	row := fmt.Sprintf("| %d | %.0f | %.0f | %.0f | %d | %.0f / %.0f / %.0f |", m.Minute, float64(m.Enqueued)/60, float64(m.Completed)/60,
		float64(m.Deliveries)/60, m.Backlog, m.P50ms, m.P99ms, m.MaxMS)
	var vacuums []string
	for _, t := range m.Tables {
		row += fmt.Sprintf(" %s (%d) |", bytesText(t.TotalBytes), t.Dead)
		vacuums = append(vacuums, fmt.Sprint(t.Autovacuums))
	}
	var purged float64
	for _, n := range m.PurgeRows {
		purged += n
	}
	slowest := "–"
	switch {
	case m.PurgeSlowestLE < 0:
		slowest = "> 10 s"
	case m.PurgeSlowestLE > 0:
		slowest = fmt.Sprintf("%g s", m.PurgeSlowestLE)
	}
	pgss := "–"
	if m.PurgeMaxMS >= 0 {
		pgss = fmt.Sprintf("%.1f", m.PurgeMaxMS)
	}
	row += fmt.Sprintf(" %s | %.0f | %d (%s) | %s | %d (%d) |", strings.Join(vacuums, " / "), purged, m.PurgeBatches, slowest, pgss,
		m.HotLockWaits, m.HotWaitsOnPurge)
	fmt.Fprintln(w, row)
}

// writeSoakVerdicts prints the targets and their outcome, and what else the end found.
func writeSoakVerdicts(w io.Writer, r *SoakReport) {
	fmt.Fprintln(w)
	for _, v := range r.Verdicts {
		fmt.Fprintf(w, "- %s %s: %s\n", v.Result, v.Target, v.Got)
	}
	var purged float64
	var archived int
	for _, m := range r.Minutes {
		for _, n := range m.PurgeRows {
			purged += n
		}
		archived = m.Archived
	}
	fmt.Fprintf(w, "- the purge deleted %.0f rows during the load; %d tasks archived", purged, archived)
	if r.EnqueueErrors > 0 {
		fmt.Fprintf(w, "; %d enqueues failed (first: %s)", r.EnqueueErrors, r.FirstEnqueueError)
	}
	fmt.Fprintln(w)
}

// failed lists the targets that failed.
func (r *SoakReport) failed() []string {
	var out []string
	for _, v := range r.Verdicts {
		if v.Result == "FAIL" {
			out = append(out, v.Target)
		}
	}
	return out
}
