package bench

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// apiPathSustain is the load generator's path of the sustained run (RunAPISustain).
const apiPathSustain = "sustain"

// The sustained run's set-up. The api keeps Idempotency-Key rows 2 minutes and purges
// them every minute (and at its start), so that a 10-minute run sees the purge several
// times and the table's size settle; the workers run their defaults.
const (
	sustainKeyRetention  = 2 * time.Minute
	sustainPurgeInterval = time.Minute
	sustainWorkers       = 3
	// sustainDrainTimeout bounds the wait, after the load, for every accepted job to
	// complete.
	sustainDrainTimeout = 2 * time.Minute
)

// APISustainReport is the sustained run's result, as docs/bench/bench-api-sustain.json holds
// it.
type APISustainReport struct {
	Revision string            `json:"revision"`
	Options  apiSustainOptions `json:"options"`
	// Autovacuum is the Postgres server's autovacuum setting: with it off, nothing
	// reclaims the dead tuples the samples count.
	Autovacuum string          `json:"autovacuum"`
	Runs       []APISustainRun `json:"runs"`
}

type apiSustainOptions struct {
	Seconds              float64  `json:"seconds"`
	Rate                 float64  `json:"rate"`
	EverySeconds         float64  `json:"every_s"`
	KeyRetentionSeconds  float64  `json:"key_retention_s"`
	PurgeIntervalSeconds float64  `json:"purge_interval_s"`
	Workers              int      `json:"workers"`
	Binaries             []string `json:"binaries"`
}

// APISustainRun is one binary's sustained run.
type APISustainRun struct {
	Config string `json:"config"`
	Binary string `json:"binary"`
	// The load as its generator saw it: calls made, those that failed (no answer, or not
	// the status wanted: 202 for a new debit, 200 for a repeat), the answers by status,
	// the achieved rate and the latencies of the calls that got the status they wanted.
	Requests   int            `json:"requests"`
	Errors     int            `json:"errors"`
	FirstError string         `json:"first_error,omitempty"`
	Codes      map[string]int `json:"codes"`
	Seconds    float64        `json:"seconds"`
	PerSecond  float64        `json:"requests_per_second"`
	P50ms      float64        `json:"p50_ms"`
	P99ms      float64        `json:"p99_ms"`
	Maxms      float64        `json:"max_ms"`
	// APIRSSIdleMiB is the api's RSS once it answered /readyz, before the load.
	APIRSSIdleMiB float64 `json:"api_rss_idle_mib"`
	// DrainSeconds is how long after the load's end every accepted job had completed, as
	// the bench polled it (every 200 ms); -1 when they had not within 2 minutes.
	DrainSeconds float64            `json:"drain_s"`
	Samples      []APISustainSample `json:"samples"`
	// Check is the end's check; nil when the run stopped before it.
	Check *APISustainCheck `json:"check,omitempty"`
}

// APISustainSample is the system's state at one moment of a sustained run.
type APISustainSample struct {
	Seconds float64 `json:"elapsed_s"` // since the load started
	// Drained marks the sample taken after the load, once every accepted job completed
	// (or the wait gave up).
	Drained bool `json:"drained,omitempty"`
	// Accepted is job_intents' rows, Completed processed_jobs' completed rows, and
	// CompletedPerSecond the completions since the last sample per second.
	Accepted           int64   `json:"accepted"`
	Completed          int64   `json:"completed"`
	CompletedPerSecond float64 `json:"completed_per_s"`
	// NotDone is the intents pending or published (not yet completed), OldestNotDoneMS
	// the oldest one's age, 0 when none.
	NotDone         int64   `json:"not_done"`
	OldestNotDoneMS float64 `json:"oldest_not_done_ms"`
	// n_live_tup and n_dead_tup of the tables (pg_stat_user_tables: they lag the
	// tables by up to a second or so), and api_idempotency_keys' exact row count.
	IntentsLive int64 `json:"job_intents_live"`
	IntentsDead int64 `json:"job_intents_dead"`
	KeysLive    int64 `json:"api_idempotency_keys_live"`
	KeysDead    int64 `json:"api_idempotency_keys_dead"`
	JobsLive    int64 `json:"processed_jobs_live"`
	JobsDead    int64 `json:"processed_jobs_dead"`
	KeyRows     int64 `json:"key_rows"`
	// The api's RSS and its CPU since the last sample (percent of one core), and the
	// workers' RSS summed.
	APIRSSMiB     float64 `json:"api_rss_mib"`
	APICPUPercent float64 `json:"api_cpu_percent"`
	WorkersRSSMiB float64 `json:"workers_rss_mib"`
}

// APISustainCheck is what the ledger and the wallet hold at the end of a sustained run.
type APISustainCheck struct {
	Accepted   int `json:"accepted"`   // job_intents rows: the references accepted
	Answered   int `json:"answered"`   // answers 202
	Completed  int `json:"completed"`  // processed_jobs completed rows
	Entries    int `json:"entries"`    // wallet_entries rows
	References int `json:"references"` // distinct references in wallet_entries
	Doubled    int `json:"doubled"`    // references with more than one entry
	Missing    int `json:"missing"`    // accepted references without an entry
	// Problems says what is wrong, each in a sentence; none when every accepted reference
	// has exactly one entry and no call failed.
	Problems []string `json:"problems,omitempty"`
}

const (
	// sustainStateSQL reads job_intents' rows, those not done and the oldest of them
	// (age in ms, 0 when none), the ledger's completed rows and the Idempotency-Key rows.
	sustainStateSQL = `SELECT (SELECT count(*) FROM job_intents),
	(SELECT count(*) FROM job_intents WHERE state IN ('pending', 'published')),
	(SELECT coalesce(extract(epoch FROM now() - min(created_at)) * 1000, 0)::float8 FROM job_intents WHERE state IN ('pending', 'published')),
	(SELECT count(*) FROM processed_jobs WHERE status = 'completed'),
	(SELECT count(*) FROM api_idempotency_keys)`
	// sustainTuplesSQL reads the tables' live and dead tuples, as the statistics have them.
	sustainTuplesSQL = `SELECT relname::text, n_live_tup, n_dead_tup FROM pg_stat_user_tables
	WHERE schemaname = current_schema() AND relname IN ('job_intents', 'api_idempotency_keys', 'processed_jobs')`
	// sustainDoneSQL reads job_intents' rows and the ledger's completed rows.
	sustainDoneSQL = `SELECT (SELECT count(*) FROM job_intents), (SELECT count(*) FROM processed_jobs WHERE status = 'completed')`
	// sustainCheckSQL reads job_intents' rows, the ledger's completed rows, wallet_entries'
	// rows and references, the references with more than one entry and the accepted
	// references (an intent's key is "debit:" and the reference) without one.
	sustainCheckSQL = `SELECT (SELECT count(*) FROM job_intents),
	(SELECT count(*) FROM processed_jobs WHERE status = 'completed'),
	(SELECT count(*) FROM wallet_entries),
	(SELECT count(DISTINCT reference) FROM wallet_entries),
	(SELECT count(*) FROM (SELECT 1 FROM wallet_entries GROUP BY reference HAVING count(*) > 1) d),
	(SELECT count(*) FROM job_intents i WHERE NOT EXISTS (SELECT 1 FROM wallet_entries w WHERE w.reference = substr(i.idempotency_key, 7)))`
)

// RunAPISustain runs the sustained run once per binary of opt.API.Binaries: `idemq api`
// (Idempotency-Key rows kept 2 minutes, purged every minute) and three `idemq worker`
// processes with their defaults, loaded for opt.API.Sustain by debits at
// opt.API.SustainRate per second from a load generator of its own (exe again), sampled
// every opt.API.SustainEvery; then it waits (up to 2 minutes) for every accepted job to
// complete and checks the wallet. Progress lines go to progress. After an error the
// report holds the runs so far, the failed one's samples included.
func RunAPISustain(ctx context.Context, opt Options, progress io.Writer) (*APISustainReport, error) {
	opt.defaults()
	a := opt.API
	a.defaults(opt.Binary)
	if len(a.Binaries) == 0 {
		return nil, errors.New("bench: the sustained run runs idemq api and worker: no idemq binary (Options.Binary, -idemq)")
	}
	rep := &APISustainReport{Revision: revision(), Options: apiSustainOptions{
		Seconds: a.Sustain.Seconds(), Rate: a.SustainRate, EverySeconds: a.SustainEvery.Seconds(),
		KeyRetentionSeconds: sustainKeyRetention.Seconds(), PurgeIntervalSeconds: sustainPurgeInterval.Seconds(),
		Workers: sustainWorkers, Binaries: a.Binaries,
	}}
	e, err := setupAPI(ctx, opt)
	if err != nil {
		return nil, err
	}
	defer e.close()
	if err := e.admin.QueryRow(ctx, `SELECT current_setting('autovacuum')`).Scan(&rep.Autovacuum); err != nil {
		return nil, fmt.Errorf("bench: read autovacuum: %w", err)
	}
	names := binaryNames(a.Binaries)
	for i, b := range a.Binaries {
		config := "sustain"
		if len(a.Binaries) > 1 {
			config += " " + names[i]
		}
		fmt.Fprintf(progress, "%s: debits at %.0f/s for %s through %s api (Idempotency-Key rows kept %s, purged every %s and at its start) to %d workers, a sample every %s\n",
			config, a.SustainRate, a.Sustain, b, sustainKeyRetention, sustainPurgeInterval, sustainWorkers, a.SustainEvery)
		run, err := e.apiSustain(ctx, opt.Self, a, b, config, progress)
		rep.Runs = append(rep.Runs, run)
		if err != nil {
			return rep, err
		}
	}
	return rep, nil
}

// mainAPISustain runs the sustained run, prints its tables and summaries and writes its
// JSON to jsonPath when set, all of it also after a failed run (with the samples taken
// until then). A failed check of the end is an error too.
func mainAPISustain(ctx context.Context, opt Options, jsonPath string, stdout, stderr io.Writer) error {
	rep, err := RunAPISustain(ctx, opt, stderr)
	if rep == nil {
		return err
	}
	errs := []error{err, WriteAPISustain(stdout, rep)}
	if jsonPath != "" {
		errs = append(errs, writeJSON(jsonPath, rep))
	}
	if p := rep.problems(); err == nil && len(p) > 0 {
		errs = append(errs, fmt.Errorf("bench: sustained run: %s", strings.Join(p, "; ")))
	}
	return errors.Join(errs...)
}

// problems returns the runs' check problems, each prefixed by its run's name.
func (r *APISustainReport) problems() []string {
	var out []string
	for _, run := range r.Runs {
		if run.Check == nil {
			continue
		}
		for _, p := range run.Check.Problems {
			out = append(out, run.Config+": "+p)
		}
	}
	return out
}

// apiSustain runs one binary's sustained run.
func (e *env) apiSustain(ctx context.Context, exe string, a APIOptions, binary, config string, progress io.Writer) (APISustainRun, error) {
	run := APISustainRun{Config: config, Binary: binary, DrainSeconds: -1}
	if err := e.resetAPI(ctx); err != nil {
		return run, err
	}
	var services []*service
	defer func() {
		for _, sv := range services {
			sv.stop()
		}
	}()
	env := append(os.Environ(), "REDIS_URL="+e.redisDB.URL, "DATABASE_URL="+e.dsn, "IDEMQ_LOG_LEVEL=error")
	addr, err := freeAddr()
	if err != nil {
		return run, err
	}
	api, err := startService(ctx, binary, "api", "http://"+addr+"/readyz", append(slices.Clone(env), apiAuthEnv(
		"IDEMQ_HTTP_ADDR="+addr,
		"IDEMQ_API_KEY_RETENTION="+sustainKeyRetention.String(), "IDEMQ_API_PURGE_INTERVAL="+sustainPurgeInterval.String())...))
	if err != nil {
		return run, err
	}
	services = append(services, api)
	var workers []*service
	for range sustainWorkers {
		maddr, err := freeAddr()
		if err != nil {
			return run, err
		}
		w, err := startService(ctx, binary, "worker", "http://"+maddr+"/readyz",
			append(slices.Clone(env), "IDEMQ_METRICS_ADDR="+maddr, "IDEMQ_FAKEPAY_URL="+e.fakepay.URL))
		if err != nil {
			return run, err
		}
		services, workers = append(services, w), append(workers, w)
	}

	args := []string{apiChildFlag, "-wait", "-path", apiPathSustain, "-prefix", "s" + randomHex(4), "-url", "http://" + addr,
		"-rate", strconv.FormatFloat(a.SustainRate, 'g', -1, 64), "-seconds", strconv.FormatFloat(a.Sustain.Seconds(), 'g', -1, 64)}
	l, err := e.startReadyLoad(ctx, exe, args)
	if err != nil {
		return run, err
	}
	defer l.kill()
	run.APIRSSIdleMiB = rssMiB(api)
	if err := l.start(); err != nil {
		return run, err
	}
	start := time.Now()
	last := sustainMark{at: start, apiCPU: api.cpu()}
	type answer struct {
		line string
		err  error
	}
	answered := make(chan answer, 1)
	go func() {
		line, err := l.next(ctx, a.Sustain+2*time.Minute)
		answered <- answer{line, err}
	}()
	sample := func(drained bool) error {
		s, err := e.sustainSample(ctx, start, &last, api, workers)
		if err != nil {
			return err
		}
		s.Drained = drained
		run.Samples = append(run.Samples, s)
		fmt.Fprintf(progress, "%s %5.0fs: accepted %d, completed %d (%.0f/s), not done %d (oldest %.0f ms), key rows %d, dead tuples: intents %d keys %d jobs %d, api RSS %.1f MiB CPU %.0f%%, workers RSS %.1f MiB\n",
			config, s.Seconds, s.Accepted, s.Completed, s.CompletedPerSecond, s.NotDone, s.OldestNotDoneMS, s.KeyRows,
			s.IntentsDead, s.KeysDead, s.JobsDead, s.APIRSSMiB, s.APICPUPercent, s.WorkersRSSMiB)
		for _, sv := range services {
			select {
			case <-sv.exited:
				return fmt.Errorf("bench: %s exited during the sustained run: %s", sv.name, sv.stderr)
			default:
			}
		}
		return nil
	}
	tick := time.NewTicker(a.SustainEvery)
	defer tick.Stop()
	var res apiLoadResult
wait:
	for {
		select {
		case <-tick.C:
			if err := sample(false); err != nil {
				return run, err
			}
		case ans := <-answered:
			if ans.err != nil {
				return run, ans.err
			}
			if err := json.Unmarshal([]byte(ans.line), &res); err != nil {
				return run, fmt.Errorf("bench: load generator's result %.200q: %w", ans.line, err)
			}
			break wait
		case <-ctx.Done():
			return run, ctx.Err()
		}
	}
	tick.Stop()
	loadEnd := time.Now()
	if err := l.finish(); err != nil {
		return run, err
	}
	run.Requests, run.Errors, run.FirstError, run.Codes, run.Seconds = res.Requests, res.Errors, res.FirstError, res.Codes, res.Seconds
	run.P50ms, run.P99ms, run.Maxms = res.P50ms, res.P99ms, res.MaxMS
	if res.Seconds > 0 {
		run.PerSecond = float64(res.Requests) / res.Seconds
	}

	// Every accepted job should complete soon after the load.
	deadline := loadEnd.Add(sustainDrainTimeout)
	for {
		var accepted, completed int64
		if err := e.admin.QueryRow(ctx, sustainDoneSQL).Scan(&accepted, &completed); err != nil {
			return run, fmt.Errorf("bench: read completions: %w", err)
		}
		if completed >= accepted {
			run.DrainSeconds = time.Since(loadEnd).Seconds()
			break
		}
		if time.Now().After(deadline) {
			break
		}
		select {
		case <-ctx.Done():
			return run, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	if err := sample(true); err != nil {
		return run, err
	}
	return run, e.sustainCheck(ctx, &run)
}

// sustainMark is what the last sample's window ends with.
type sustainMark struct {
	at        time.Time
	completed int64
	apiCPU    float64
}

// sustainSample reads the system's state, the window's rates from last, and moves last
// on.
func (e *env) sustainSample(ctx context.Context, start time.Time, last *sustainMark, api *service, workers []*service) (APISustainSample, error) {
	now := time.Now()
	s := APISustainSample{Seconds: now.Sub(start).Seconds()}
	if err := e.admin.QueryRow(ctx, sustainStateSQL).Scan(&s.Accepted, &s.NotDone, &s.OldestNotDoneMS, &s.Completed, &s.KeyRows); err != nil {
		return s, fmt.Errorf("bench: read the sustained run's state: %w", err)
	}
	rows, err := e.admin.Query(ctx, sustainTuplesSQL)
	if err != nil {
		return s, fmt.Errorf("bench: read pg_stat_user_tables: %w", err)
	}
	var name string
	var live, dead int64
	_, err = pgx.ForEachRow(rows, []any{&name, &live, &dead}, func() error {
		switch name {
		case "job_intents":
			s.IntentsLive, s.IntentsDead = live, dead
		case "api_idempotency_keys":
			s.KeysLive, s.KeysDead = live, dead
		case "processed_jobs":
			s.JobsLive, s.JobsDead = live, dead
		}
		return nil
	})
	if err != nil {
		return s, fmt.Errorf("bench: read pg_stat_user_tables: %w", err)
	}
	cpu := api.cpu()
	s.APIRSSMiB = rssMiB(api)
	for _, w := range workers {
		s.WorkersRSSMiB += rssMiB(w)
	}
	if d := now.Sub(last.at).Seconds(); d > 0 {
		s.CompletedPerSecond = float64(s.Completed-last.completed) / d
		s.APICPUPercent = (cpu - last.apiCPU) / d * 100
	}
	*last = sustainMark{at: now, completed: s.Completed, apiCPU: cpu}
	return s, nil
}

// sustainCheck reads the ledger and the wallet into run.Check and lists what is wrong.
func (e *env) sustainCheck(ctx context.Context, run *APISustainRun) error {
	c := &APISustainCheck{}
	if err := e.admin.QueryRow(ctx, sustainCheckSQL).Scan(&c.Accepted, &c.Completed, &c.Entries, &c.References, &c.Doubled, &c.Missing); err != nil {
		return fmt.Errorf("bench: check the wallet: %w", err)
	}
	c.Answered = run.Codes[strconv.Itoa(http.StatusAccepted)]
	if run.Errors > 0 {
		c.Problems = append(c.Problems, fmt.Sprintf("%d of %d requests failed (first: %s)", run.Errors, run.Requests, run.FirstError))
	}
	if c.Answered != c.Accepted {
		c.Problems = append(c.Problems, fmt.Sprintf("%d answers 202 but %d intents recorded", c.Answered, c.Accepted))
	}
	if c.Completed != c.Accepted {
		c.Problems = append(c.Problems, fmt.Sprintf("%d of %d accepted jobs completed within %s of the load's end", c.Completed, c.Accepted, sustainDrainTimeout))
	}
	if c.Entries != c.Accepted || c.References != c.Accepted || c.Doubled > 0 || c.Missing > 0 {
		c.Problems = append(c.Problems, fmt.Sprintf("wallet_entries has %d rows over %d references for %d accepted references: %d references with more than one entry, %d accepted without one",
			c.Entries, c.References, c.Accepted, c.Doubled, c.Missing))
	}
	run.Check = c
	return nil
}

// rssMiB returns the service's resident memory (VmRSS) in MiB, 0 when unreadable.
func rssMiB(sv *service) float64 {
	st, err := readStatus(sv.cmd.Process.Pid)
	if err != nil {
		return 0
	}
	return float64(st.rss) / (1 << 20)
}

// WriteAPISustain prints each sustained run's samples as a table and a summary: the
// request rate achieved against the rate asked, answers and latencies, the completion
// rate, the api's memory, the Idempotency-Key rows against what the purge should keep,
// the dead tuples, and the end's check.
func WriteAPISustain(w io.Writer, rep *APISustainReport) error {
	o := rep.Options
	retention, interval := time.Duration(o.KeyRetentionSeconds*float64(time.Second)), time.Duration(o.PurgeIntervalSeconds*float64(time.Second))
	for i, run := range rep.Runs {
		if i > 0 {
			fmt.Fprintln(w)
		}
		fmt.Fprintf(w, "%s (%s): debits at %.0f/s for %s through idemq api (Idempotency-Key rows kept %s, purged every %s and at the api's start) to %d idemq workers (their defaults), a sample every %s\n\n",
			run.Config, run.Binary, o.Rate, time.Duration(o.Seconds*float64(time.Second)), retention, interval, o.Workers, time.Duration(o.EverySeconds*float64(time.Second)))
		fmt.Fprintln(w, "| elapsed s | accepted | completed | completed/s | not done | oldest not done ms | job_intents live / dead | api_idempotency_keys live / dead | processed_jobs live / dead | key rows | api RSS MiB | api CPU % | workers RSS MiB |")
		fmt.Fprintln(w, "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
		var load []APISustainSample
		for _, s := range run.Samples {
			at := fmt.Sprintf("%.0f", s.Seconds)
			if s.Drained {
				at += " (drained)"
			} else {
				load = append(load, s)
			}
			fmt.Fprintf(w, "| %s | %d | %d | %.0f | %d | %.0f | %d / %d | %d / %d | %d / %d | %d | %.1f | %.0f | %.1f |\n",
				at, s.Accepted, s.Completed, s.CompletedPerSecond, s.NotDone, s.OldestNotDoneMS, s.IntentsLive, s.IntentsDead,
				s.KeysLive, s.KeysDead, s.JobsLive, s.JobsDead, s.KeyRows, s.APIRSSMiB, s.APICPUPercent, s.WorkersRSSMiB)
		}
		fmt.Fprintln(w)
		if run.Requests == 0 {
			fmt.Fprintln(w, "- the run stopped before the load's end")
		} else {
			codes := slices.Sorted(maps.Keys(run.Codes))
			answers := make([]string, len(codes))
			for i, c := range codes {
				answers[i] = fmt.Sprintf("%s ×%d", c, run.Codes[c])
			}
			fmt.Fprintf(w, "- requests: %d in %.1f s = %.0f/s (asked %.0f/s); answers %s; HTTP p50 %.1f ms, p99 %.1f ms, max %.1f ms; errors %d\n",
				run.Requests, run.Seconds, run.PerSecond, o.Rate, strings.Join(answers, ", "), run.P50ms, run.P99ms, run.Maxms, run.Errors)
			if run.FirstError != "" {
				fmt.Fprintf(w, "  - first error: %s\n", run.FirstError)
			}
		}
		if len(load) == 0 {
			continue
		}
		rates := make([]float64, len(load))
		for i, s := range load {
			rates[i] = s.CompletedPerSecond
		}
		drain := fmt.Sprintf("every accepted job completed %.1f s after the load's end", run.DrainSeconds)
		switch {
		case run.Requests == 0:
			drain = "the load did not end"
		case run.DrainSeconds < 0:
			drain = fmt.Sprintf("not every accepted job completed within %s of the load's end", sustainDrainTimeout)
		}
		first, lastS := load[0], load[len(load)-1]
		fmt.Fprintf(w, "- completion: %.0f jobs/s over the load (windows %.0f–%.0f/s) against %.0f accepted/s; %d intents not done at the last sample of the load (oldest %.1f s); %s\n",
			float64(lastS.Completed)/lastS.Seconds, slices.Min(rates), slices.Max(rates), float64(lastS.Accepted)/lastS.Seconds,
			lastS.NotDone, lastS.OldestNotDoneMS/1000, drain)
		maxRSS := slices.MaxFunc(load, func(a, b APISustainSample) int { return cmp.Compare(a.APIRSSMiB, b.APIRSSMiB) }).APIRSSMiB
		fmt.Fprintf(w, "- api RSS: %.1f → %.1f MiB (max %.1f; %.1f MiB idle before the load); workers %.1f → %.1f MiB\n",
			first.APIRSSMiB, lastS.APIRSSMiB, maxRSS, run.APIRSSIdleMiB, first.WorkersRSSMiB, lastS.WorkersRSSMiB)
		rate := run.PerSecond
		if rate == 0 {
			rate = o.Rate
		}
		keys := fmt.Sprintf("- Idempotency-Key rows: %d → %d over the load (max %d)",
			first.KeyRows, lastS.KeyRows, slices.MaxFunc(load, func(a, b APISustainSample) int { return cmp.Compare(a.KeyRows, b.KeyRows) }).KeyRows)
		if end := run.Samples[len(run.Samples)-1]; end.Drained {
			keys += fmt.Sprintf(", %d at %.0f s (drained)", end.KeyRows, end.Seconds)
		}
		keys += fmt.Sprintf("; kept %s and purged every %s, they should stay between %.0f and %.0f (%.0f requests/s × %s to %s) from about %s after the start, when the first purge finds rows older than %s",
			retention, interval, rate*retention.Seconds(), rate*(retention+interval).Seconds(), rate, retention, retention+interval, retention+interval, retention)
		if time.Duration(o.Seconds*float64(time.Second)) < retention+interval {
			keys += "; this run's load ended before that"
		}
		fmt.Fprintln(w, keys)
		dead := func(f func(APISustainSample) int64) int64 {
			var m int64
			for _, s := range run.Samples {
				m = max(m, f(s))
			}
			return m
		}
		fmt.Fprintf(w, "- dead tuples, max: job_intents %d, api_idempotency_keys %d, processed_jobs %d (autovacuum %s on this server)\n",
			dead(func(s APISustainSample) int64 { return s.IntentsDead }), dead(func(s APISustainSample) int64 { return s.KeysDead }),
			dead(func(s APISustainSample) int64 { return s.JobsDead }), rep.Autovacuum)
		switch c := run.Check; {
		case c == nil:
		case len(c.Problems) == 0:
			fmt.Fprintf(w, "- check: each of the %d accepted references has exactly one wallet entry, every job completed, no request failed\n", c.Accepted)
		default:
			fmt.Fprintf(w, "- check FAILED: %s\n", strings.Join(c.Problems, "; "))
		}
	}
	return nil
}
