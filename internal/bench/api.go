package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// API mode (-workloads api, RunAPI) measures the web side as users run it: `idemq api`
// processes answering POST /v1/charges, loaded by a process of its own (this binary
// again, as `idemq-bench -api-child`), beside the floors the same charges reach without
// the API, from the same kind of process at the same concurrency: asynq's own client (not
// durable), one plain INSERT per request (durable), and the outbox client from Go
// (Enqueue; EnqueueTx in the caller's transaction, then Wake), its relay running in the
// background. The e2e path sends debits through `idemq api` to one `idemq worker` at a
// low fixed rate and times each from its send to its completion in the ledger.
//
// Every repetition runs every path once, the order rotated each repetition, and the
// throughput of each sample is divided by the insert floor's and asynq's of the same
// repetition.
//
// With APIOptions.Sustain set, API mode is instead one sustained run per binary
// (RunAPISustain): debits at a fixed rate through `idemq api` to three `idemq worker`
// processes for minutes, the outbox, the ledger, the Idempotency-Key table and the
// processes' memory sampled as it goes.

// API mode's paths, in the order a run measures them.
const (
	APIPathAPI       = "api"       // POST /v1/charges to `idemq api`, one row per binary
	APIPathAsynq     = "asynq"     // asynq.Client.Enqueue of the same task: not durable, no HTTP
	APIPathInsert    = "insert"    // one INSERT into bench_floor per request: the durable floor
	APIPathEnqueue   = "enqueue"   // outbox.Client.Enqueue from Go, the relay in the background
	APIPathEnqueueTx = "enqueuetx" // pgx.BeginFunc → outbox.Client.EnqueueTx → commit, then Wake
	APIPathE2E       = "e2e"       // debits through `idemq api` to one `idemq worker`, send to completion
)

// APIPathNames lists API mode's paths, in the order a run measures them.
var APIPathNames = []string{APIPathAPI, APIPathAsynq, APIPathInsert, APIPathEnqueue, APIPathEnqueueTx, APIPathE2E}

// apiChildFlag, first among idemq-bench's arguments, makes the process API mode's load
// generator (runAPIChild).
const apiChildFlag = "-api-child"

// Bounds of one sample's waits.
const (
	apiReadyTimeout = time.Minute      // an api, a worker or the load generator to be ready
	apiE2ETimeout   = time.Minute      // every e2e key to complete once the sends are done
	apiStopTimeout  = 45 * time.Second // a process to exit after SIGTERM (the api waits up to 30 s for requests)
)

// APIOptions configures API mode. The zero value of a field means its default.
type APIOptions struct {
	// Seconds is how long the load of each throughput sample runs. Default 10.
	Seconds float64 `json:"seconds"`
	// Concurrency is the requests the load keeps in flight (one goroutine each) in each
	// throughput sample. Default 50.
	Concurrency int `json:"concurrency"`
	// Binaries are the idemq binaries whose api (and, on the e2e path, worker) the api
	// and e2e paths run, a row each. Default: Options.Binary.
	Binaries []string `json:"binaries"`
	// Paths are the paths measured, of APIPathNames. Default all.
	Paths []string `json:"paths"`
	// E2ERate is the e2e path's arrival rate, debits per second. Default 20.
	E2ERate float64 `json:"e2e_rate"`
	// E2ESeconds is how long the e2e path sends. Default 10.
	E2ESeconds float64 `json:"e2e_seconds"`
	// Sustain, when positive, makes API mode one sustained run per binary of this length
	// instead of the paths (RunAPISustain). Default 0: the paths.
	Sustain time.Duration `json:"-"`
	// SustainRate is the sustained run's arrival rate, debits per second. Default 1500.
	SustainRate float64 `json:"-"`
	// SustainEvery is how often the sustained run takes a sample. Default 30s.
	SustainEvery time.Duration `json:"-"`
}

func (a *APIOptions) defaults(binary string) {
	if a.Seconds <= 0 {
		a.Seconds = 10
	}
	if a.Concurrency <= 0 {
		a.Concurrency = 50
	}
	if len(a.Binaries) == 0 && binary != "" {
		a.Binaries = []string{binary}
	}
	if len(a.Paths) == 0 {
		a.Paths = APIPathNames
	}
	if a.E2ERate <= 0 {
		a.E2ERate = 20
	}
	if a.E2ESeconds <= 0 {
		a.E2ESeconds = 10
	}
	if a.SustainRate <= 0 {
		a.SustainRate = 1500
	}
	if a.SustainEvery <= 0 {
		a.SustainEvery = 30 * time.Second
	}
}

// APISample is one path's run in one repetition.
type APISample struct {
	Path string `json:"path"`
	// Config names the row: the path, or "api NAME" and "e2e NAME" when several
	// binaries are compared.
	Config      string  `json:"config"`
	Binary      string  `json:"binary,omitempty"` // the idemq binary of the api and e2e paths
	Rep         int     `json:"rep"`
	Concurrency int     `json:"concurrency,omitempty"`
	Seconds     float64 `json:"seconds"` // the load's elapsed time
	Requests    int     `json:"requests"`
	Errors      int     `json:"errors"`
	FirstError  string  `json:"first_error,omitempty"`
	// PerSecond is accepted requests (Requests − Errors) per second; P50ms and P99ms are
	// their latencies as the load generator saw them.
	PerSecond float64 `json:"requests_per_second"`
	P50ms     float64 `json:"p50_ms"`
	P99ms     float64 `json:"p99_ms"`
	// CommitsPerSecond is the bench database's xact_commit (pg_stat_database, so other
	// clients of the database count too) over the load, per second of it;
	// RowsPerCommit is accepted requests per commit.
	CommitsPerSecond float64 `json:"commits_per_second"`
	RowsPerCommit    float64 `json:"rows_per_commit"`
	// OldestPendingMS is the age of the oldest intent still pending (not yet handed to
	// asynq) when the load ended, 0 when none; Intents is job_intents' rows then.
	OldestPendingMS float64 `json:"oldest_pending_ms"`
	Intents         int     `json:"intents"`
	// CPU per accepted request, microseconds: the api process (api path), the load
	// generator's process (on the asynq, insert and enqueue paths the Go client's own
	// cost; on the api path the HTTP client's), redis-server (shared: other clients count
	// too) and this run's Postgres backends plus its WAL writer, checkpointer and
	// background writer.
	CPUAPI   float64 `json:"cpu_us_api"`
	CPULoad  float64 `json:"cpu_us_load"`
	CPURedis float64 `json:"cpu_us_redis"`
	CPUPG    float64 `json:"cpu_us_pg"`
	// Throughput ÷ the insert floor's and asynq's of the same repetition (0 without them).
	RatioInsert float64 `json:"ratio_insert,omitempty"`
	RatioAsynq  float64 `json:"ratio_asynq,omitempty"`
	// The e2e path: the arrival rate and, over the accepted debits, the time from each
	// request's send to the ledger's completed_at (its completing transaction's now()).
	Rate     float64 `json:"rate,omitempty"`
	E2EP50ms float64 `json:"e2e_p50_ms,omitempty"`
	E2EP99ms float64 `json:"e2e_p99_ms,omitempty"`
	E2EMaxms float64 `json:"e2e_max_ms,omitempty"`
}

// APIReport is API mode's result, as docs/bench/bench-api.json holds it.
type APIReport struct {
	Revision string           `json:"revision"`
	Options  apiReportOptions `json:"options"`
	Samples  []APISample      `json:"samples"`
}

type apiReportOptions struct {
	Reps int `json:"reps"`
	APIOptions
}

// apiStep is one path of a repetition.
type apiStep struct {
	path   string
	config string
	binary string // the api and e2e paths
}

func apiSteps(a APIOptions) ([]apiStep, error) {
	names := binaryNames(a.Binaries)
	var steps []apiStep
	for _, p := range a.Paths {
		switch p = strings.TrimSpace(p); p {
		case APIPathAPI, APIPathE2E:
			if len(a.Binaries) == 0 {
				return nil, fmt.Errorf("bench: the %s path runs idemq api: no idemq binary (Options.Binary, -idemq)", p)
			}
			for i, b := range a.Binaries {
				config := p
				if len(a.Binaries) > 1 {
					config += " " + names[i]
				}
				steps = append(steps, apiStep{path: p, config: config, binary: b})
			}
		case APIPathAsynq, APIPathInsert, APIPathEnqueue, APIPathEnqueueTx:
			steps = append(steps, apiStep{path: p, config: p})
		default:
			return nil, fmt.Errorf("bench: unknown api path %q (one of %s)", p, strings.Join(APIPathNames, ", "))
		}
	}
	return steps, nil
}

// binaryNames names each binary by the fewest trailing elements of its path that tell the
// binaries apart: idemq alone, bin/idemq beside bin-before/idemq.
func binaryNames(bins []string) []string {
	parts := make([][]string, len(bins))
	for i, b := range bins {
		parts[i] = strings.Split(filepath.ToSlash(filepath.Clean(b)), "/")
	}
	for k := 1; ; k++ {
		names := make([]string, len(bins))
		seen := map[string]bool{}
		unique, whole := true, true
		for i, p := range parts {
			names[i] = strings.Join(p[max(0, len(p)-k):], "/")
			unique = unique && !seen[names[i]]
			seen[names[i]] = true
			whole = whole && k >= len(p)
		}
		if unique || whole {
			return names
		}
	}
}

// createFloorSQL is the insert path's table: a key and the task's payload per request.
const createFloorSQL = `CREATE TABLE IF NOT EXISTS bench_floor (
	key        text        PRIMARY KEY,
	payload    jsonb       NOT NULL,
	created_at timestamptz NOT NULL DEFAULT now()
)`

// RunAPI runs API mode: reps repetitions, each running every path of opt.API once in an
// order rotated each repetition. Progress lines go to progress.
func RunAPI(ctx context.Context, opt Options, progress io.Writer) (*APIReport, error) {
	opt.defaults()
	opt.API.defaults(opt.Binary)
	rep := &APIReport{Revision: revision(), Options: apiReportOptions{Reps: opt.Reps, APIOptions: opt.API}}
	steps, err := apiSteps(opt.API)
	if err != nil {
		return nil, err
	}
	e, err := setupAPI(ctx, opt)
	if err != nil {
		return nil, err
	}
	defer e.close()
	// Open the admin pool's every connection now: a sample waits for the backends that
	// appeared during it to exit, and one of this pool's would not.
	if err := warmPool(ctx, e.admin); err != nil {
		return nil, err
	}
	for r := range opt.Reps {
		order := slices.Clone(steps)
		for range r % len(order) {
			order = append(order[1:], order[0])
		}
		for _, st := range order {
			s, err := e.apiSample(ctx, opt.Self, opt.API, st, r)
			if err != nil {
				return rep, err
			}
			if s.Path == APIPathE2E {
				fmt.Fprintf(progress, "api %-24s rep %d: %5d debits at %.0f/s, send to completion p50 %6.1f ms p99 %6.1f ms max %6.1f ms, HTTP p50 %5.1f ms p99 %5.1f ms, errors %d\n",
					s.Config, s.Rep, s.Requests, s.Rate, s.E2EP50ms, s.E2EP99ms, s.E2EMaxms, s.P50ms, s.P99ms, s.Errors)
			} else {
				fmt.Fprintf(progress, "api %-24s rep %d: %7d requests in %5.2fs = %7.0f/s, p50 %6.1f ms p99 %6.1f ms, errors %d, %5.0f commits/s, %5.2f rows/commit, oldest pending %5.0f ms, intents %d, CPU µs api %.0f load %.0f Redis %.0f PG %.0f\n",
					s.Config, s.Rep, s.Requests, s.Seconds, s.PerSecond, s.P50ms, s.P99ms, s.Errors, s.CommitsPerSecond, s.RowsPerCommit,
					s.OldestPendingMS, s.Intents, s.CPUAPI, s.CPULoad, s.CPURedis, s.CPUPG)
			}
			if s.FirstError != "" {
				fmt.Fprintf(progress, "    first error: %s\n", s.FirstError)
			}
			rep.Samples = append(rep.Samples, s)
		}
	}
	pairAPIRatios(rep.Samples)
	return rep, nil
}

// warmPool opens every connection pool may hold, and gives them back.
func warmPool(ctx context.Context, pool *pgxpool.Pool) error {
	conns := make([]*pgxpool.Conn, 0, pool.Config().MaxConns)
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for range pool.Config().MaxConns {
		c, err := pool.Acquire(ctx)
		if err != nil {
			return fmt.Errorf("bench: open the pool's connections: %w", err)
		}
		conns = append(conns, c)
	}
	return nil
}

// resetAPI is reset, and it also empties what only API mode writes: the api's
// Idempotency-Key rows, the insert floor, and redis_epochs (each sample's relays then
// start from a Redis database that never had an epoch marker, as after a fresh install).
func (e *env) resetAPI(ctx context.Context) error {
	if err := e.reset(ctx); err != nil {
		return err
	}
	if _, err := e.admin.Exec(ctx, `TRUNCATE api_idempotency_keys, bench_floor, redis_epochs`); err != nil {
		return fmt.Errorf("bench: truncate: %w", err)
	}
	return nil
}

const (
	// intentsSQL reads the age (ms) of the oldest intent not yet handed to asynq, 0 when
	// none, and the count of intents.
	intentsSQL = `SELECT coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE state = 'pending')) * 1000, 0)::float8,
	count(*)::int FROM job_intents`
	// xactCommitSQL reads the commits of the bench database so far, every client's.
	xactCommitSQL = `SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()`
	// backendsSQL lists this run's Postgres backends: its own and its processes'.
	backendsSQL = `SELECT pid FROM pg_stat_activity WHERE application_name = $1`
	// completedSQL reads when each of the keys completed (unix µs).
	completedSQL = `SELECT idempotency_key, (extract(epoch FROM completed_at) * 1e6)::bigint FROM processed_jobs
	WHERE status = 'completed' AND idempotency_key = ANY($1)`
)

// apiSample runs one path once: it resets the state, starts the idemq processes the path
// needs and the load generator (exe), and reads what the load did and cost.
func (e *env) apiSample(ctx context.Context, exe string, a APIOptions, st apiStep, rep int) (APISample, error) {
	s := APISample{Path: st.path, Config: st.config, Binary: st.binary, Rep: rep + 1}
	e2e := st.path == APIPathE2E
	args := []string{apiChildFlag, "-wait", "-path", st.path, "-prefix", fmt.Sprintf("r%d%s", rep+1, randomHex(4))}
	loadTime := a.Seconds
	if e2e {
		s.Rate, loadTime = a.E2ERate, a.E2ESeconds
		args = append(args, "-rate", strconv.FormatFloat(a.E2ERate, 'g', -1, 64))
	} else {
		s.Concurrency = a.Concurrency
		args = append(args, "-c", strconv.Itoa(a.Concurrency))
	}
	args = append(args, "-seconds", strconv.FormatFloat(loadTime, 'g', -1, 64))
	if err := e.resetAPI(ctx); err != nil {
		return s, err
	}
	before, err := e.backends(ctx)
	if err != nil {
		return s, err
	}

	var services []*service
	stopServices := func() {
		for _, sv := range services {
			sv.stop()
		}
		services = nil
	}
	defer stopServices()
	var api *service
	if st.binary != "" {
		env := append(os.Environ(), "REDIS_URL="+e.redisDB.URL, "DATABASE_URL="+e.dsn, "IDEMQ_LOG_LEVEL=error")
		addr, err := freeAddr()
		if err != nil {
			return s, err
		}
		if api, err = startService(ctx, st.binary, "api", "http://"+addr+"/readyz",
			append(slices.Clone(env), apiAuthEnv("IDEMQ_HTTP_ADDR="+addr)...)); err != nil {
			return s, err
		}
		services = append(services, api)
		args = append(args, "-url", "http://"+addr)
		if e2e {
			maddr, err := freeAddr()
			if err != nil {
				return s, err
			}
			w, err := startService(ctx, st.binary, "worker", "http://"+maddr+"/readyz",
				append(slices.Clone(env), "IDEMQ_METRICS_ADDR="+maddr, "IDEMQ_FAKEPAY_URL="+e.fakepay.URL))
			if err != nil {
				return s, err
			}
			services = append(services, w)
		}
	}

	l, err := e.startReadyLoad(ctx, exe, args)
	if err != nil {
		return s, err
	}
	defer l.kill()
	cpu0, api0, load0 := e.probe.snap(ctx), api.cpu(), l.cpu()
	var commits0, commits1 int64
	if err := e.admin.QueryRow(ctx, xactCommitSQL).Scan(&commits0); err != nil {
		return s, fmt.Errorf("bench: read xact_commit: %w", err)
	}
	if err := l.start(); err != nil {
		return s, err
	}
	line, err := l.next(ctx, time.Duration(loadTime*float64(time.Second))+2*time.Minute)
	if err != nil {
		return s, err
	}
	var res apiLoadResult
	if err := json.Unmarshal([]byte(line), &res); err != nil {
		return s, fmt.Errorf("bench: load generator's result %.200q: %w", line, err)
	}
	cpu1, api1, load1 := e.probe.snap(ctx), api.cpu(), l.cpu()
	if err := e.admin.QueryRow(ctx, intentsSQL).Scan(&s.OldestPendingMS, &s.Intents); err != nil {
		return s, fmt.Errorf("bench: read job_intents: %w", err)
	}
	if err := l.finish(); err != nil {
		return s, err
	}
	s.Requests, s.Errors, s.FirstError, s.P50ms, s.P99ms, s.Seconds = res.Requests, res.Errors, res.FirstError, res.P50ms, res.P99ms, res.Seconds
	accepted := res.Requests - res.Errors
	if e2e {
		return s, e.e2eLatencies(ctx, &s, res.Sends)
	}

	// The processes' backends report their statistics as they exit.
	stopServices()
	e.waitBackends(ctx, before, 10*time.Second)
	if err := e.admin.QueryRow(ctx, xactCommitSQL).Scan(&commits1); err != nil {
		return s, fmt.Errorf("bench: read xact_commit: %w", err)
	}
	if s.Seconds > 0 {
		s.PerSecond = float64(accepted) / s.Seconds
		s.CommitsPerSecond = float64(commits1-commits0) / s.Seconds
	}
	if commits1 > commits0 {
		s.RowsPerCommit = float64(accepted) / float64(commits1-commits0)
	}
	if accepted > 0 {
		per := 1e6 / float64(accepted)
		d := cpu0.to(cpu1)
		s.CPUAPI, s.CPULoad, s.CPURedis, s.CPUPG = (api1-api0)*per, (load1-load0)*per, d.redis*per, d.pg*per
	}
	switch st.path {
	case APIPathAPI, APIPathEnqueue, APIPathEnqueueTx:
		if s.Intents != accepted {
			return s, fmt.Errorf("bench: %s rep %d: %d intents recorded for %d accepted requests: every accepted request must have its intent", st.config, s.Rep, s.Intents, accepted)
		}
	}
	return s, nil
}

// backends returns the pids of this run's Postgres backends.
func (e *env) backends(ctx context.Context) (map[int]bool, error) {
	rows, err := e.admin.Query(ctx, backendsSQL, e.appName)
	if err != nil {
		return nil, fmt.Errorf("bench: list backends: %w", err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil, fmt.Errorf("bench: list backends: %w", err)
	}
	set := make(map[int]bool, len(pids))
	for _, p := range pids {
		set[p] = true
	}
	return set, nil
}

// waitBackends waits, up to d, until this run's backends are those of before: a backend
// reports its statistics (pg_stat_database's xact_commit) when it exits, while an idle
// one may hold them back for up to 10 s.
func (e *env) waitBackends(ctx context.Context, before map[int]bool, d time.Duration) {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		now, err := e.backends(ctx)
		if err != nil {
			return
		}
		gone := true
		for p := range now {
			gone = gone && before[p]
		}
		if gone {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// e2eLatencies waits (up to apiE2ETimeout) until the ledger has completed every sent key
// and sets s's send-to-completion percentiles.
func (e *env) e2eLatencies(ctx context.Context, s *APISample, sends []apiSend) error {
	if len(sends) == 0 {
		return fmt.Errorf("bench: %s rep %d: no debit accepted (%d errors; first: %s)", s.Config, s.Rep, s.Errors, s.FirstError)
	}
	keys := make([]string, len(sends))
	for i, d := range sends {
		keys[i] = d.Key
	}
	done := map[string]int64{}
	deadline := time.Now().Add(apiE2ETimeout)
	for len(done) < len(keys) {
		rows, err := e.admin.Query(ctx, completedSQL, keys)
		if err != nil {
			return fmt.Errorf("bench: read completions: %w", err)
		}
		var key string
		var at int64
		_, err = pgx.ForEachRow(rows, []any{&key, &at}, func() error {
			done[key] = at
			return nil
		})
		if err != nil {
			return fmt.Errorf("bench: read completions: %w", err)
		}
		if len(done) == len(keys) {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("bench: %s rep %d: %d of %d debits completed within %s of the last send", s.Config, s.Rep, len(done), len(keys), apiE2ETimeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	lat := make([]time.Duration, len(sends))
	for i, d := range sends {
		lat[i] = time.Duration(done[d.Key]*1000 - d.SentNS)
	}
	slices.Sort(lat)
	s.E2EP50ms, s.E2EP99ms, s.E2EMaxms = millis(percentile(lat, 0.50)), millis(percentile(lat, 0.99)), millis(lat[len(lat)-1])
	return nil
}

func millis(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e6 }

// service is an idemq process a sample runs against: `idemq api` or `idemq worker`.
type service struct {
	name   string
	cmd    *exec.Cmd
	stderr *tailBuffer
	exited chan struct{}
}

// startService starts `binary sub` with env and waits until readyURL answers 200.
func startService(ctx context.Context, binary, sub, readyURL string, env []string) (*service, error) {
	cmd := exec.CommandContext(ctx, binary, sub)
	cmd.Env = env
	cmd.SysProcAttr = childAttr()
	sv := &service{name: binary + " " + sub, cmd: cmd, stderr: &tailBuffer{max: 4096}, exited: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = io.Discard, sv.stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("bench: start %s: %w", sv.name, err)
	}
	go func() {
		cmd.Wait()
		close(sv.exited)
	}()
	client := &http.Client{Timeout: 2 * time.Second}
	deadline := time.Now().Add(apiReadyTimeout)
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, readyURL, nil)
		if err != nil {
			sv.stop()
			return nil, fmt.Errorf("bench: %w", err)
		}
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return sv, nil
			}
		}
		select {
		case <-sv.exited:
			return nil, fmt.Errorf("bench: %s exited before %s answered 200: %s", sv.name, readyURL, sv.stderr)
		case <-ctx.Done():
			sv.stop()
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			sv.stop()
			return nil, fmt.Errorf("bench: %s: %s did not answer 200 within %s: %s", sv.name, readyURL, apiReadyTimeout, sv.stderr)
		}
	}
}

// cpu returns the process's CPU time so far, in seconds; 0 for no service.
func (sv *service) cpu() float64 {
	if sv == nil {
		return 0
	}
	return childCPU([]*exec.Cmd{sv.cmd})
}

// stop sends SIGTERM and waits for the exit, killing the process after apiStopTimeout.
func (sv *service) stop() {
	select {
	case <-sv.exited:
		return
	default:
	}
	sv.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-sv.exited:
	case <-time.After(apiStopTimeout):
		sv.cmd.Process.Kill()
		<-sv.exited
	}
}

// load is the load generator's process (runAPIChild with -wait): it writes "ready" on
// stdout once set up, starts on a line on its stdin, writes its apiLoadResult as one line
// of JSON, and exits when its stdin closes.
type load struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string
	exited chan struct{}
	err    error // the exit's, once exited is closed
	stderr *tailBuffer
}

// apiToken is the bearer token of the `idemq api` processes this run starts, which the
// load generator sends, so that the API is measured as it runs in production. It is never
// printed.
var apiToken = randomHex(32)

// apiAuthEnv is env with the settings that guard an `idemq api` process: a token for /v1/,
// and a user and password for the dashboard.
func apiAuthEnv(env ...string) []string {
	return append(env, "IDEMQ_API_TOKEN="+apiToken, "IDEMQ_DASHBOARD_USER=bench", "IDEMQ_DASHBOARD_PASSWORD="+randomHex(16))
}

// startLoad starts exe with args, the run's Redis and Postgres in its environment. The
// process dies with this one (see childAttr). ChildEnv routes it in a test binary.
func startLoad(exe string, args []string, redisURL, databaseURL string) (*load, error) {
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), "REDIS_URL="+redisURL, "DATABASE_URL="+databaseURL, ChildEnv+"=1", "IDEMQ_API_TOKEN="+apiToken)
	cmd.SysProcAttr = childAttr()
	l := &load{cmd: cmd, lines: make(chan string, 4), exited: make(chan struct{}), stderr: &tailBuffer{max: 4096}}
	cmd.Stderr = l.stderr
	var err error
	if l.stdin, err = cmd.StdinPipe(); err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("bench: start the load generator: %w", err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 64<<10), 256<<20)
		for sc.Scan() {
			l.lines <- sc.Text()
		}
		close(l.lines)
		l.err = cmd.Wait()
		close(l.exited)
	}()
	return l, nil
}

// next returns the process's next line of output, waiting up to d for it.
func (l *load) next(ctx context.Context, d time.Duration) (string, error) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case line, ok := <-l.lines:
		if !ok {
			<-l.exited
			return "", fmt.Errorf("bench: the load generator exited (%v): %s", l.err, l.stderr)
		}
		return line, nil
	case <-t.C:
		return "", fmt.Errorf("bench: the load generator said nothing for %s: %s", d, l.stderr)
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

// cpu returns the process's CPU time so far, in seconds.
func (l *load) cpu() float64 { return childCPU([]*exec.Cmd{l.cmd}) }

// start lets the load begin.
func (l *load) start() error {
	if _, err := io.WriteString(l.stdin, "go\n"); err != nil {
		return fmt.Errorf("bench: start the load: %w: %s", err, l.stderr)
	}
	return nil
}

// finish closes the process's stdin and waits for its exit.
func (l *load) finish() error {
	l.stdin.Close()
	select {
	case <-l.exited:
	case <-time.After(apiStopTimeout):
		l.kill()
		return fmt.Errorf("bench: the load generator did not exit within %s of its stdin closing: %s", apiStopTimeout, l.stderr)
	}
	if l.err != nil {
		return fmt.Errorf("bench: the load generator: %w: %s", l.err, l.stderr)
	}
	return nil
}

// kill ends the process if it still runs and waits for it.
func (l *load) kill() {
	select {
	case <-l.exited:
		return
	default:
	}
	l.cmd.Process.Kill()
	for range l.lines {
	}
	<-l.exited
}

// pairAPIRatios sets each throughput sample's ratios to the insert floor's and asynq's
// throughput of the same repetition.
func pairAPIRatios(ss []APISample) {
	floor, asq := map[int]float64{}, map[int]float64{}
	for _, s := range ss {
		switch s.Path {
		case APIPathInsert:
			floor[s.Rep] = s.PerSecond
		case APIPathAsynq:
			asq[s.Rep] = s.PerSecond
		}
	}
	for i := range ss {
		s := &ss[i]
		if s.Path == APIPathE2E {
			continue
		}
		if f := floor[s.Rep]; f > 0 {
			s.RatioInsert = s.PerSecond / f
		}
		if a := asq[s.Rep]; a > 0 {
			s.RatioAsynq = s.PerSecond / a
		}
	}
}

// WriteAPITable prints API mode's tables: per throughput path and binary the median
// requests per second (min–max), the latencies, the medians of the per-repetition ratios
// to the insert floor and to asynq, commits, the oldest pending intent and CPU per
// request (of the api process on the api path, of the Go client on the others); then per
// binary the e2e path's send-to-completion latencies.
func WriteAPITable(w io.Writer, samples []APISample) error {
	by := map[string][]APISample{}
	var order []string
	for _, s := range samples {
		if _, ok := by[s.Config]; !ok {
			order = append(order, s.Config)
		}
		by[s.Config] = append(by[s.Config], s)
	}
	col := func(ss []APISample, f func(APISample) float64) []float64 {
		out := make([]float64, 0, len(ss))
		for _, s := range ss {
			if v := f(s); v > 0 {
				out = append(out, v)
			}
		}
		return out
	}
	ratio := func(v []float64) string {
		if len(v) == 0 {
			return "-"
		}
		return fmt.Sprintf("**%.2f** (%.2f–%.2f)", median(v), slices.Min(v), slices.Max(v))
	}
	var e2e []string
	fmt.Fprintln(w, "| path | requests/s | p50 ms | p99 ms | ÷ insert (paired) | ÷ asynq (paired) | commits/s | rows per commit | oldest pending ms | CPU µs/request: api or Go client + Redis + PG |")
	fmt.Fprintln(w, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
	for _, c := range order {
		ss := by[c]
		if ss[0].Path == APIPathE2E {
			e2e = append(e2e, c)
			continue
		}
		rates := collectAPI(ss, func(s APISample) float64 { return s.PerSecond })
		toInsert, toAsynq := ratio(col(ss, func(s APISample) float64 { return s.RatioInsert })), ratio(col(ss, func(s APISample) float64 { return s.RatioAsynq }))
		if ss[0].Path == APIPathInsert {
			toInsert = "1"
		}
		if ss[0].Path == APIPathAsynq {
			toAsynq = "1"
		}
		med := func(f func(APISample) float64) float64 { return median(collectAPI(ss, f)) }
		ca := med(func(s APISample) float64 { return s.CPULoad })
		if ss[0].Path == APIPathAPI {
			ca = med(func(s APISample) float64 { return s.CPUAPI })
		}
		cr, cp := med(func(s APISample) float64 { return s.CPURedis }), med(func(s APISample) float64 { return s.CPUPG })
		// asynq's path commits nothing: the commits during it are other clients'.
		perCommit := "-"
		if ss[0].Path != APIPathAsynq {
			perCommit = fmt.Sprintf("%.2f", med(func(s APISample) float64 { return s.RowsPerCommit }))
		}
		fmt.Fprintf(w, "| %s | %.0f (%.0f–%.0f) | %.1f | %.1f | %s | %s | %.0f | %s | %.0f | %.0f + %.0f + %.0f = %.0f |\n",
			c, median(rates), slices.Min(rates), slices.Max(rates),
			med(func(s APISample) float64 { return s.P50ms }), med(func(s APISample) float64 { return s.P99ms }),
			toInsert, toAsynq, med(func(s APISample) float64 { return s.CommitsPerSecond }), perCommit,
			med(func(s APISample) float64 { return s.OldestPendingMS }), ca, cr, cp, ca+cr+cp)
	}
	if len(e2e) == 0 {
		return nil
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| e2e | debits/s | debits | send → completed p50 ms | p99 ms | max ms (all reps) | HTTP p50 ms |")
	fmt.Fprintln(w, "|---|--:|--:|--:|--:|--:|--:|")
	for _, c := range e2e {
		ss := by[c]
		med := func(f func(APISample) float64) float64 { return median(collectAPI(ss, f)) }
		fmt.Fprintf(w, "| %s | %.0f | %.0f | %.1f | %.1f | %.1f | %.1f |\n", c, ss[0].Rate, med(func(s APISample) float64 { return float64(s.Requests - s.Errors) }),
			med(func(s APISample) float64 { return s.E2EP50ms }), med(func(s APISample) float64 { return s.E2EP99ms }),
			slices.Max(collectAPI(ss, func(s APISample) float64 { return s.E2EMaxms })), med(func(s APISample) float64 { return s.P50ms }))
	}
	return nil
}

func collectAPI(ss []APISample, f func(APISample) float64) []float64 {
	out := make([]float64, len(ss))
	for i, s := range ss {
		out[i] = f(s)
	}
	return out
}

// startReadyLoad starts the load generator (with -wait among args) and waits for its
// "ready".
func (e *env) startReadyLoad(ctx context.Context, exe string, args []string) (*load, error) {
	l, err := startLoad(exe, args, e.redisDB.URL, e.dsn)
	if err != nil {
		return nil, err
	}
	line, err := l.next(ctx, apiReadyTimeout)
	if err == nil && line != "ready" {
		err = fmt.Errorf("bench: load generator said %q, want ready", line)
	}
	if err != nil {
		l.kill()
		return nil, err
	}
	return l, nil
}

// setupAPI is setup with the insert floor's table.
func setupAPI(ctx context.Context, opt Options) (*env, error) {
	e, err := setup(ctx, opt)
	if err != nil {
		return nil, err
	}
	if _, err := e.admin.Exec(ctx, createFloorSQL); err != nil {
		e.close()
		return nil, fmt.Errorf("bench: create bench_floor: %w", err)
	}
	return e, nil
}
