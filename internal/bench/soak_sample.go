package bench

import (
	"context"
	"fmt"
	"math"
	"sort"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	dto "github.com/prometheus/client_model/go"

	"github.com/idemq/idemq/tasks"
)

// purgeStatementRE matches the purge's statements (POSIX, case-insensitive): deletes
// from the ledger's tables, which nothing else the worker runs does, and a partition's
// detach, drop or truncate.
const purgeStatementRE = `delete\s+from\s+(processed_jobs|processed_job_events|job_intents)\M|detach\s+partition|drop\s+table|truncate`

const (
	// soakEffectsSQL reads the run's wallet entries ($3: the references' pattern) whose
	// transaction began in [$1, $2): their count and the latency from the enqueue time
	// their reference carries (after its second '-', µs) to their created_at, in ms:
	// p50, p99, max.
	soakEffectsSQL = `SELECT count(*),
	coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY lat), 0)::float8,
	coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY lat), 0)::float8,
	coalesce(max(lat), 0)::float8
FROM (SELECT extract(epoch FROM created_at)::float8 * 1000 - split_part(reference, '-', 3)::float8 / 1000 AS lat
      FROM wallet_entries WHERE created_at >= $1 AND created_at < $2 AND reference LIKE $3) e`
	// soakTablesSQL reads each table of $1, a partitioned one's leaf partitions summed:
	// its partitions (0 when not partitioned), total and index size, live and dead
	// tuples, autovacuums and autoanalyzes; zeros for a table that does not exist.
	soakTablesSQL = soakMembers + `
SELECT t.name, count(m.relid) FILTER (WHERE m.part)::int,
	coalesce(sum(pg_total_relation_size(m.relid)), 0)::bigint, coalesce(sum(pg_indexes_size(m.relid)), 0)::bigint,
	coalesce(sum(s.n_live_tup), 0)::bigint, coalesce(sum(s.n_dead_tup), 0)::bigint,
	coalesce(sum(s.autovacuum_count), 0)::bigint, coalesce(sum(s.autoanalyze_count), 0)::bigint
FROM t LEFT JOIN m ON m.name = t.name LEFT JOIN pg_stat_user_tables s ON s.relid = m.relid
GROUP BY t.name`
	// soakIndexesSQL reads the size of each index of the tables of $1, a partitioned
	// index's partitions summed under its name.
	soakIndexesSQL = soakMembers + `
SELECT m.name, coalesce(pg_partition_root(i.indexrelid), i.indexrelid)::regclass::text, sum(pg_relation_size(i.indexrelid))::bigint
FROM m JOIN pg_index i ON i.indrelid = m.relid
GROUP BY 1, 2`
	// soakMembers names the tables of $1 (t) and the relations holding their rows (m):
	// a table itself, or a partitioned one's leaf partitions (part).
	soakMembers = `WITH t AS (SELECT name, to_regclass(name) AS rel FROM unnest($1::text[]) name),
m AS (SELECT t.name, t.rel::oid AS relid, false AS part FROM t JOIN pg_class c ON c.oid = t.rel WHERE c.relkind <> 'p'
      UNION ALL
      SELECT t.name, p.relid::oid, true FROM t JOIN pg_class c ON c.oid = t.rel AND c.relkind = 'p'
      CROSS JOIN LATERAL pg_partition_tree(t.rel) p WHERE p.isleaf)`
	// soakStatementsSQL reads the longest execution of a statement matching $1 (the
	// purge's) in this database, ms, since pg_stat_statements was last reset.
	soakStatementsSQL = `SELECT coalesce(max(max_exec_time), 0)::float8 FROM public.pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) AND query ~* $1`
	// soakLockWaitsSQL counts the database's backends waiting for a lock now: those not
	// running a statement matching $1 (the purge's), those of them blocked by one that
	// is, and those that are.
	soakLockWaitsSQL = `SELECT count(*) FILTER (WHERE NOT purge)::int, count(*) FILTER (WHERE NOT purge AND behind_purge)::int,
	count(*) FILTER (WHERE purge)::int
FROM (SELECT a.query ~* $1 AS purge,
             EXISTS (SELECT FROM pg_stat_activity b WHERE b.pid = ANY (pg_blocking_pids(a.pid)) AND b.query ~* $1) AS behind_purge
      FROM pg_stat_activity a
      WHERE a.wait_event_type = 'Lock' AND a.datname = current_database() AND a.pid <> pg_backend_pid()) w`
	// soakDoubledSQL counts the run's references ($1: their pattern) with more than one
	// wallet entry.
	soakDoubledSQL = `SELECT count(*)::int FROM (SELECT FROM wallet_entries WHERE reference LIKE $1 GROUP BY reference HAVING count(*) > 1) d`
)

// enableStatements creates pg_stat_statements in the database and says whether it can
// be read (it needs the library preloaded).
func (e *env) enableStatements(ctx context.Context) bool {
	if _, err := e.admin.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements SCHEMA public`); err != nil {
		return false
	}
	var ms float64
	return e.admin.QueryRow(ctx, soakStatementsSQL, purgeStatementRE).Scan(&ms) == nil
}

// resetSoak empties Redis and the tables, history included, and zeroes the database's
// statistics (and statement statistics, when statements), so that a soak's counts are
// its own.
func (e *env) resetSoak(ctx context.Context, statements bool) error {
	if err := e.reset(ctx); err != nil {
		return err
	}
	if _, err := e.admin.Exec(ctx, `TRUNCATE processed_job_events`); err != nil {
		return fmt.Errorf("bench: truncate: %w", err)
	}
	if _, err := e.admin.Exec(ctx, `SELECT pg_stat_reset()`); err != nil {
		return fmt.Errorf("bench: reset statistics: %w", err)
	}
	if statements {
		if _, err := e.admin.Exec(ctx, `SELECT public.pg_stat_statements_reset()`); err != nil {
			return fmt.Errorf("bench: reset statement statistics: %w", err)
		}
	}
	return nil
}

// soakSpan is what a minute's sample reads.
type soakSpan struct {
	minute     int
	from, to   time.Time // the minute
	prefix     string    // the run's references
	metricsURL string
	statements bool // pg_stat_statements can be read
}

// soakMark is the counters at the last sample, which the next one's deltas start from.
type soakMark struct {
	sent, dups, processed int64
	purgeRows             map[string]float64
	purge                 purgeHistogram
}

// soakSample reads a minute's row at its end, but for its completions (soakEffects),
// and moves last on.
func (e *env) soakSample(ctx context.Context, sp soakSpan, p *soakProducer, locks *lockCounts, last *soakMark) (SoakMinute, error) {
	m := SoakMinute{Minute: sp.minute, PurgeMaxMS: -1}
	sent, dups := p.counts()
	m.Enqueued, m.Duplicates = sent-last.sent, dups-last.dups
	failed, _ := p.errors()
	m.Behind = max(0, p.pace.before(time.Since(p.pace.start))-sent-failed)
	m.LockSamples, m.HotLockWaits, m.HotWaitsOnPurge, m.PurgeLockWaits = locks.take()
	q, err := asynq.NewInspectorFromRedisClient(e.rdb).GetQueueInfo(tasks.Queue)
	if err != nil {
		return m, fmt.Errorf("bench: read the queue: %w", err)
	}
	m.Deliveries = int64(q.ProcessedTotal) - last.processed
	m.Backlog, m.Archived = q.Pending+q.Active+q.Scheduled+q.Retry, q.Archived
	if m.Tables, err = e.soakTables(ctx); err != nil {
		return m, err
	}
	if sp.statements {
		if err := e.admin.QueryRow(ctx, soakStatementsSQL, purgeStatementRE).Scan(&m.PurgeMaxMS); err != nil {
			return m, fmt.Errorf("bench: read pg_stat_statements: %w", err)
		}
	}
	fams := scrape(ctx, sp.metricsURL)
	if fams == nil {
		return m, fmt.Errorf("bench: read the worker's metrics at %s", sp.metricsURL)
	}
	rows := labelled(fams, "idemq_purge_rows_total", "table")
	m.PurgeRows = map[string]float64{}
	for t, n := range rows {
		m.PurgeRows[t] = n - last.purgeRows[t]
	}
	h := readPurgeHistogram(fams)
	m.PurgeBatches, m.PurgeOver1s, m.PurgeSlowestLE = h.since(last.purge)
	*last = soakMark{sent: sent, dups: dups, processed: int64(q.ProcessedTotal), purgeRows: rows, purge: h}
	return m, nil
}

// soakEffects reads the completions of m's minute and their latency into m: the wallet
// entries whose transaction began within it, read once those have committed.
func (e *env) soakEffects(ctx context.Context, sp soakSpan, m *SoakMinute) error {
	if err := e.admin.QueryRow(ctx, soakEffectsSQL, sp.from, sp.to, sp.prefix+"-%").Scan(&m.Completed, &m.P50ms, &m.P99ms, &m.MaxMS); err != nil {
		return fmt.Errorf("bench: read the minute's completions: %w", err)
	}
	return nil
}

// soakTables reads soakTables' sizes, tuples and vacuums, in their order.
func (e *env) soakTables(ctx context.Context) ([]SoakTable, error) {
	by := map[string]*SoakTable{}
	out := make([]SoakTable, len(soakTables))
	for i, t := range soakTables {
		out[i] = SoakTable{Name: t, Indexes: map[string]int64{}}
		by[t] = &out[i]
	}
	rows, err := e.admin.Query(ctx, soakTablesSQL, soakTables)
	if err != nil {
		return nil, fmt.Errorf("bench: read the tables' sizes: %w", err)
	}
	var r SoakTable
	if _, err := pgx.ForEachRow(rows, []any{&r.Name, &r.Partitions, &r.TotalBytes, &r.IndexBytes, &r.Live, &r.Dead, &r.Autovacuums, &r.Autoanalyzes}, func() error {
		if t := by[r.Name]; t != nil {
			r.Indexes = t.Indexes
			*t = r
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("bench: read the tables' sizes: %w", err)
	}
	if rows, err = e.admin.Query(ctx, soakIndexesSQL, soakTables); err != nil {
		return nil, fmt.Errorf("bench: read the indexes' sizes: %w", err)
	}
	var table, index string
	var size int64
	if _, err := pgx.ForEachRow(rows, []any{&table, &index, &size}, func() error {
		if t := by[table]; t != nil {
			t.Indexes[index] = size
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("bench: read the indexes' sizes: %w", err)
	}
	return out, nil
}

// labelled sums the counter name's series by the value of their label.
func labelled(fams map[string]*dto.MetricFamily, name, label string) map[string]float64 {
	out := map[string]float64{}
	for _, m := range fams[name].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == label {
				out[l.GetValue()] += m.GetCounter().GetValue()
			}
		}
	}
	return out
}

// purgeHistogram is idemq_purge_seconds at a scrape: its observations and its buckets'
// cumulative counts by upper bound, in ascending order.
type purgeHistogram struct {
	count  int64
	bounds []float64
	counts []int64
}

func readPurgeHistogram(fams map[string]*dto.MetricFamily) purgeHistogram {
	var h purgeHistogram
	for _, m := range fams["idemq_purge_seconds"].GetMetric() {
		hist := m.GetHistogram()
		h.count += int64(hist.GetSampleCount())
		for _, b := range hist.GetBucket() {
			i := sort.SearchFloat64s(h.bounds, b.GetUpperBound())
			if i == len(h.bounds) || h.bounds[i] != b.GetUpperBound() {
				h.bounds = append(h.bounds[:i], append([]float64{b.GetUpperBound()}, h.bounds[i:]...)...)
				h.counts = append(h.counts[:i], append([]int64{0}, h.counts[i:]...)...)
			}
			h.counts[i] += int64(b.GetCumulativeCount())
		}
	}
	return h
}

// since returns what h observed after last: the observations, those over 1 s, and the
// upper bound of the lowest bucket holding them all (0 for none, -1 when some are past
// the last bucket).
func (h purgeHistogram) since(last purgeHistogram) (n, over1s int64, slowestLE float64) {
	at := func(hh purgeHistogram, bound float64) int64 {
		for i, b := range hh.bounds {
			if b == bound {
				return hh.counts[i]
			}
		}
		return 0
	}
	n = h.count - last.count
	if n == 0 {
		return 0, 0, 0
	}
	// Over 1 s: past the highest bucket bound of at most 1 s (1 s itself, as the worker's
	// buckets are).
	under := -1.0
	for _, b := range h.bounds {
		if b <= 1 {
			under = b
		}
	}
	over1s = n
	if under > 0 {
		over1s = n - (at(h, under) - at(last, under))
	}
	for i, b := range h.bounds {
		if !math.IsInf(b, 1) && h.counts[i]-at(last, b) == n {
			return n, over1s, b
		}
	}
	return n, over1s, -1
}
