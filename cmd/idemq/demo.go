package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	mrand "math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/config"
	"github.com/idemq/idemq/internal/dial"
	"github.com/idemq/idemq/internal/localserver"
	"github.com/idemq/idemq/migrations"
	"github.com/idemq/idemq/tasks"
)

func demoCommand() command {
	return command{
		name:    "demo",
		usage:   "demo [--charges N] [--debits N] [--checkouts N] [--duplicates F] [--workers N] [--keep]",
		summary: "the whole story on one machine: API, workers, provider, duplicates and a killed worker — then the same without guards",
		run: func(ctx context.Context, _ any, args []string, stdout, stderr io.Writer) error {
			fs := flag.NewFlagSet("demo", flag.ContinueOnError)
			fs.SetOutput(stderr)
			o := demoOptions{}
			fs.IntVar(&o.charges, "charges", 200, "payment:charge jobs (orders)")
			fs.IntVar(&o.debits, "debits", 200, "wallet:debit jobs (references)")
			fs.IntVar(&o.checkouts, "checkouts", 100, "order:checkout jobs (orders charged, recorded and emailed a receipt)")
			fs.Float64Var(&o.dups, "duplicates", 0.5, "share of jobs sent again: a repeated API request, plus a duplicate delivery straight to asynq")
			fs.IntVar(&o.workers, "workers", 3, "worker processes")
			fs.BoolVar(&o.keep, "keep", false, "keep the demo's Postgres schemas and leave the stack running until Ctrl-C")
			fs.BoolVar(&o.skipUnguarded, "skip-unguarded", false, "do not run the comparison without guards")
			if err := fs.Parse(args); err != nil {
				return err
			}
			if o.charges < 0 || o.debits < 0 || o.checkouts < 0 || o.charges+o.debits+o.checkouts == 0 || o.workers < 2 || o.dups < 0 || o.dups > 1 {
				return errors.New("demo: want --charges/--debits/--checkouts ≥ 0 (not all 0), --workers ≥ 2, 0 ≤ --duplicates ≤ 1")
			}
			return runDemo(ctx, o, stdout)
		},
	}
}

type demoOptions struct {
	charges, debits, checkouts, workers int
	dups                                float64
	keep, skipUnguarded                 bool
}

// demoRun is what one phase of the demo measured.
type demoRun struct {
	guarded                                  bool
	requests, accepted, replayed, duplicates int64
	conflict                                 int64
	directDups, nudges                       int64
	deliveries                               int
	lockBusy, ledgerBusy, cacheHits          float64
	providerRequests, providerReplays        int
	charges, chargeMax, entries, entryMax    int
	chargeOrders, entryRefs                  int
	// Checkouts: their charges, order rows and receipt emails, each by order; resent are
	// the emails sent by a claim that did not record its receipt step (with guards: one
	// that died or lost its lease between the email and its record).
	checkoutCharges, checkoutChargeMax int
	orderRows, orderRowMax, checkouts  int
	emails, emailMax, emailed, resent  int
	incomplete                         int
	killed                             bool
	elapsed                            time.Duration
	ticks                              demoTicks
}

func runDemo(ctx context.Context, o demoOptions, out io.Writer) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	redisURL, dbURL, cleanup, err := demoServers(ctx, out)
	if err != nil {
		return err
	}
	defer cleanup()

	fmt.Fprintf(out, "idemq demo: %d charges, %d debits and %d checkouts, %.0f%% sent twice, %d workers; worker 1 is SIGKILLed once a quarter of the jobs are done\n",
		o.charges, o.debits, o.checkouts, o.dups*100, o.workers)
	guarded, err := demoPhase(ctx, o, exe, redisURL, dbURL, true, out)
	if err != nil {
		return err
	}
	runs := []*demoRun{guarded}
	if !o.skipUnguarded && ctx.Err() == nil {
		fmt.Fprintln(out, "\nThe same workload with the lock and the ledger switched off (IDEMQ_UNSAFE_NO_GUARDS):")
		unguarded, err := demoPhase(ctx, o, exe, redisURL, dbURL, false, out)
		if err != nil {
			return err
		}
		runs = append(runs, unguarded)
	}
	fmt.Fprintln(out)
	printDemoTable(out, runs)
	if guarded.incomplete > 0 || guarded.chargeMax != 1 && o.charges > 0 || guarded.entryMax != 1 && o.debits > 0 ||
		guarded.chargeOrders != o.charges || guarded.entryRefs != o.debits ||
		o.checkouts > 0 && (guarded.checkoutChargeMax != 1 || guarded.orderRowMax != 1 || guarded.checkouts != o.checkouts ||
			guarded.emailed != o.checkouts || guarded.emails != o.checkouts+guarded.resent) || !guarded.ticks.ok() {
		return fmt.Errorf("demo: with guards, some effect did not happen exactly once (see the table)")
	}
	fmt.Fprintln(out)
	fmt.Fprintln(out, demoVerdict(runs))
	return nil
}

// demoVerdict is the demo's last line: what the guarded run kept single and, when the
// unguarded run ran, how many duplicate effects the guards prevented.
func demoVerdict(runs []*demoRun) string {
	g := runs[0]
	through := "through duplicate requests and deliveries"
	switch {
	case g.killed && g.ticks.schedKilled:
		through = "through duplicate requests and deliveries, a SIGKILLed worker and a SIGKILLed scheduler"
	case g.killed:
		through += " and a SIGKILLed worker"
	}
	line := fmt.Sprintf("With guards: %d orders charged once each and %d debits written once each", g.chargeOrders, g.entryRefs)
	if g.checkouts > 0 {
		line = fmt.Sprintf("With guards: %d orders charged once each, %d debits written once each and %d checkouts charged, recorded and emailed once each", g.chargeOrders, g.entryRefs, g.checkouts)
	}
	line += fmt.Sprintf(", and %d ticks settled once each", g.ticks.settled)
	line += ", " + through + "."
	if g.resent > 0 {
		line += fmt.Sprintf("\nBut %d receipts were emailed again: the delivery that sent each stopped (its worker killed, or its lease lost) before it recorded the step, so the next one sent it again, with the same step key, which this provider does not honour.", g.resent)
	}
	if len(runs) < 2 {
		return line
	}
	u := runs[1]
	extraEntries := u.entries - u.entryRefs
	extraOrders, extraEmails := u.orderRows-u.checkouts, u.emails-u.emailed
	prevented := extraEntries + extraOrders + max(extraEmails-g.resent, 0) + max(u.providerReplays-g.providerReplays, 0)
	return fmt.Sprintf("%s\nWithout guards: %d debits written twice, %d order rows and %d receipt emails too many, and %d charges sent to the provider again, which only its key kept single. The guards prevented %d duplicates.",
		line, extraEntries, extraOrders, extraEmails, u.providerReplays, prevented)
}

// demoServers returns a Redis and a Postgres to use: REDIS_URL/DATABASE_URL (or their
// defaults) when they answer, else private servers started from the installed binaries.
func demoServers(ctx context.Context, out io.Writer) (redisURL, dbURL string, cleanup func(), err error) {
	redisURL = firstNonEmpty(os.Getenv("REDIS_URL"), defaultRedisURL)
	dbURL = firstNonEmpty(os.Getenv("DATABASE_URL"), defaultDatabaseURL)
	var closers []func() error
	cleanup = func() {
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]()
		}
	}
	pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if rdb, err := dial.RedisNode(pctx, redisURL); err == nil {
		rdb.Close()
	} else {
		fmt.Fprintf(out, "Redis at %s does not answer (%v); starting a private redis-server\n", config.RedactURL(redisURL), err)
		srv, err := localserver.StartRedis(localserver.PersistNone)
		if err != nil {
			return "", "", cleanup, fmt.Errorf("demo: no Redis: %w", err)
		}
		closers = append(closers, srv.Close)
		redisURL = srv.URL
	}
	if pool, err := dial.Postgres(pctx, dbURL, 1); err == nil {
		pool.Close()
	} else {
		fmt.Fprintf(out, "Postgres does not answer (%v); starting a private postgres\n", err)
		srv, err := localserver.StartPostgres()
		if err != nil {
			cleanup()
			return "", "", func() {}, fmt.Errorf("demo: no Postgres: %w", err)
		}
		closers = append(closers, srv.Close)
		dbURL = srv.URL
	}
	return redisURL, dbURL, cleanup, nil
}

func firstNonEmpty(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// demoStack is one phase's processes and connections.
type demoStack struct {
	exe, logDir     string
	env             []string
	workers         []*exec.Cmd
	schedulers      []*exec.Cmd
	metrics         []string
	lastScrape      []map[string]float64
	mu              sync.Mutex
	apiURL, fakepay string
	pool            *pgxpool.Pool
	rdb             *redis.Client
	procs           []*exec.Cmd
	schema          *localserver.Schema
	redisURL        string
	redisDB         *localserver.RedisDB
}

func demoPhase(ctx context.Context, o demoOptions, exe, redisURL, dbURL string, guarded bool, out io.Writer) (_ *demoRun, err error) {
	st, err := startDemoStack(ctx, exe, redisURL, dbURL, o.workers, guarded, out)
	defer func() { st.close(ctx, o.keep, err != nil, out) }()
	if err != nil {
		return nil, err
	}
	run := &demoRun{guarded: guarded}
	start := time.Now()

	// The workload: every job through the API; a share of them again (the same request,
	// sometimes concurrently, sometimes with another Idempotency-Key), and straight to
	// asynq under another TaskID, so duplicate deliveries race in the workers.
	type job struct {
		path, body string
		spec       outbox.Spec
	}
	var jobs []job
	var specs []outbox.Spec
	tag := randomHex(3)
	for i := range max(o.charges, o.debits, o.checkouts) {
		if i < o.charges {
			c := tasks.Charge{OrderID: fmt.Sprintf("%s-%d", tag, i), CustomerID: fmt.Sprintf("cust-%d", i%17), AmountCents: int64(500 + i), Currency: "EUR"}
			spec, _ := tasks.ChargeSpec(c)
			jobs = append(jobs, job{"/v1/charges", string(spec.Payload), spec})
			specs = append(specs, spec)
		}
		if i < o.debits {
			d := tasks.Debit{AccountID: fmt.Sprintf("acct-%d", i%13), AmountCents: int64(100 + i), Reference: fmt.Sprintf("%s-%d", tag, i)}
			spec, _ := tasks.DebitSpec(d)
			jobs = append(jobs, job{"/v1/wallet/debits", string(spec.Payload), spec})
			specs = append(specs, spec)
		}
		if i < o.checkouts {
			c := tasks.Checkout{OrderID: fmt.Sprintf("%s-co-%d", tag, i), CustomerID: fmt.Sprintf("cust-%d", i%17), AmountCents: int64(900 + i), Currency: "EUR",
				Email: fmt.Sprintf("buyer-%d@example.com", i)}
			spec, _ := tasks.CheckoutSpec(c)
			jobs = append(jobs, job{"/v1/checkouts", string(spec.Payload), spec})
			specs = append(specs, spec)
		}
	}
	client := asynq.NewClientFromRedisClient(st.rdb)
	post := func(path, body, key string) {
		code, replayed, err := demoPost(ctx, st.apiURL+path, body, key)
		atomic.AddInt64(&run.requests, 1)
		switch {
		case err != nil:
		case replayed:
			atomic.AddInt64(&run.replayed, 1)
		case code == http.StatusAccepted:
			atomic.AddInt64(&run.accepted, 1)
		case code == http.StatusOK:
			atomic.AddInt64(&run.duplicates, 1)
		case code == http.StatusConflict:
			atomic.AddInt64(&run.conflict, 1)
		}
	}
	work := make(chan job)
	var wg sync.WaitGroup
	for range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range work {
				header := ""
				if mrand.IntN(2) == 0 {
					header = "req-" + randomHex(8)
				}
				if mrand.Float64() >= o.dups {
					post(j.path, j.body, header)
					continue
				}
				var dwg sync.WaitGroup
				dwg.Add(2)
				go func() { defer dwg.Done(); post(j.path, j.body, header) }()
				go func() {
					defer dwg.Done()
					time.Sleep(time.Duration(mrand.IntN(3)) * time.Millisecond)
					if mrand.IntN(3) == 0 {
						post(j.path, j.body, "other-"+randomHex(8)) // another header key, same order
					} else {
						post(j.path, j.body, header)
					}
				}()
				dwg.Wait()
				task := j.spec.Task(j.spec.Key+"#dup", time.Now())
				if _, err := client.EnqueueContext(ctx, task); err == nil {
					atomic.AddInt64(&run.directDups, 1)
				}
			}
		}()
	}
	for _, j := range jobs {
		select {
		case work <- j:
		case <-ctx.Done():
		}
	}
	close(work)
	wg.Wait()

	// Drain: wait until every job is completed. Deliveries the killed worker held come back
	// only after asynq's own recovery (60–120 s); a duplicate delivery under another TaskID
	// lets a live worker take them over as soon as their lease ends.
	total := len(jobs)
	keys := make([]string, len(specs))
	for i, sp := range specs {
		keys[i] = sp.Key
	}
	deadline := time.Now().Add(3 * time.Minute)
	lastNudge, lastLine := time.Now(), time.Time{}
	tty := isTerminal(out)
	for {
		st.scrape()
		done, err := st.finished(ctx, guarded, keys)
		if err != nil {
			return nil, err
		}
		if !run.killed && done >= total/4 && done < total {
			// Kill a worker while it is busy: deliveries it holds stop between their
			// effect and their completion.
			run.killed = true
			st.workers[0].Process.Signal(syscall.SIGKILL)
			fmt.Fprintf(out, "  SIGKILLed worker 1 (pid %d) with %d of %d jobs finished\n", st.workers[0].Process.Pid, done, total)
		}
		switch {
		case tty:
			fmt.Fprintf(out, "\r  %s: %d/%d jobs finished, %s elapsed   ", phaseName(guarded), done, total, time.Since(start).Round(100*time.Millisecond))
		case time.Since(lastLine) >= 2*time.Second || done == total:
			fmt.Fprintf(out, "  %s: %d/%d jobs finished, %s elapsed\n", phaseName(guarded), done, total, time.Since(start).Round(100*time.Millisecond))
			lastLine = time.Now()
		}
		if done == total || time.Now().After(deadline) || ctx.Err() != nil {
			run.incomplete = total - done
			break
		}
		if time.Since(lastNudge) > nudgeEvery(guarded, run.killed) {
			n, err := st.nudge(ctx, client, guarded, specs)
			if err != nil {
				return nil, err
			}
			run.nudges += int64(n)
			lastNudge = time.Now()
		}
		// Until the kill, look often: a fast run can go from under a quarter to done
		// between two looks, and the demo would then show no kill at all.
		if run.killed {
			time.Sleep(250 * time.Millisecond)
		} else {
			time.Sleep(25 * time.Millisecond)
		}
	}
	if tty {
		fmt.Fprintln(out)
	}
	if err := st.drainTicks(ctx, guarded, &run.ticks, out); err != nil {
		return nil, err
	}
	run.elapsed = time.Since(start)
	return run, st.measure(ctx, run)
}

func phaseName(guarded bool) string {
	if guarded {
		return "with guards"
	}
	return "without guards"
}

// demoPost sends one API request and returns the status and whether it was a replay of an
// earlier answer to the same Idempotency-Key.
func demoPost(ctx context.Context, url, body, idemKey string) (int, bool, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return 0, false, err
	}
	req.Header.Set("Content-Type", "application/json")
	if idemKey != "" {
		req.Header.Set("Idempotency-Key", idemKey)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, false, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed") == "true", nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// The defaults of REDIS_URL and DATABASE_URL (internal/config).
const (
	defaultRedisURL    = "redis://127.0.0.1:6379/0"
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
)

func startDemoStack(ctx context.Context, exe, redisURL, dbURL string, workers int, guarded bool, out io.Writer) (*demoStack, error) {
	st := &demoStack{exe: exe}
	var err error
	if st.logDir, err = os.MkdirTemp("", "idemq-demo-"); err != nil {
		return st, err
	}

	// A Postgres schema of its own, migrated.
	if st.schema, err = localserver.CreateSchema(ctx, dbURL, "idemq_demo_"+randomHex(4), nil); err != nil {
		return st, fmt.Errorf("demo: %w", err)
	}
	dsn := st.schema.URL
	if st.pool, err = dial.Postgres(ctx, dsn, 8); err != nil {
		return st, err
	}
	if err := migrateDSN(ctx, st.pool); err != nil {
		return st, err
	}

	// An empty Redis database of its own, leased so tests and other demos keep out:
	// asynq's keys cannot be prefixed.
	if st.redisDB, err = localserver.LeaseRedisDB(ctx, redisURL, true); err != nil {
		return st, fmt.Errorf("demo: %w", err)
	}
	st.redisURL = st.redisDB.URL
	if st.rdb, err = dial.RedisNode(ctx, st.redisURL); err != nil {
		return st, err
	}

	base := []string{}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IDEMQ_") && !strings.HasPrefix(kv, "REDIS_URL=") && !strings.HasPrefix(kv, "DATABASE_URL=") {
			base = append(base, kv)
		}
	}
	base = append(base, "DATABASE_URL="+dsn, "REDIS_URL="+st.redisURL, "IDEMQ_LOG_LEVEL=warn")

	fp, _ := localserver.FreePort()
	st.fakepay = fmt.Sprintf("http://127.0.0.1:%d", fp)
	if err := st.start("fakepay", append(base, fmt.Sprintf("IDEMQ_FAKEPAY_ADDR=127.0.0.1:%d", fp), "IDEMQ_FAKEPAY_DELAY=30ms"), st.fakepay+"/healthz"); err != nil {
		return st, err
	}
	st.env = append(base, "IDEMQ_FAKEPAY_URL="+st.fakepay, "IDEMQ_CONCURRENCY=8", "IDEMQ_LEASE=1s", "IDEMQ_LOCK_TTL=1s",
		"IDEMQ_SHUTDOWN_TIMEOUT=5s", fmt.Sprintf("IDEMQ_UNSAFE_NO_GUARDS=%t", !guarded))
	for i := range workers {
		port, _ := localserver.FreePort()
		murl := fmt.Sprintf("http://127.0.0.1:%d", port)
		if err := st.start(fmt.Sprintf("worker%d", i+1), append(st.env, fmt.Sprintf("IDEMQ_METRICS_ADDR=127.0.0.1:%d", port)), murl+"/readyz"); err != nil {
			return st, err
		}
		st.workers = append(st.workers, st.procs[len(st.procs)-1])
		st.metrics = append(st.metrics, murl+"/metrics")
		st.lastScrape = append(st.lastScrape, nil)
	}
	ap, _ := localserver.FreePort()
	st.apiURL = fmt.Sprintf("http://127.0.0.1:%d", ap)
	if err := st.start("api", append(base, fmt.Sprintf("IDEMQ_HTTP_ADDR=127.0.0.1:%d", ap)), st.apiURL+"/readyz"); err != nil {
		return st, err
	}
	file, err := demoScheduleFile(st.logDir)
	if err != nil {
		return st, err
	}
	if err := st.startSchedulers(file); err != nil {
		return st, err
	}
	fmt.Fprintf(out, "\n%s: API %s, dashboard %s/monitoring/, ledger %s/ledger/ (schema %s, logs in %s)\n",
		phaseName(guarded), st.apiURL, st.apiURL, st.apiURL, st.schema.Name, st.logDir)
	return st, nil
}

// start runs `idemq name` with env and waits until ready answers 200.
func (st *demoStack) start(name string, env []string, ready string) error {
	logf, err := os.Create(filepath.Join(st.logDir, name+".log"))
	if err != nil {
		return err
	}
	sub := strings.TrimRight(name, "0123456789")
	cmd := exec.Command(st.exe, sub)
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("demo: start %s: %w", name, err)
	}
	st.procs = append(st.procs, cmd)
	go func() { cmd.Wait(); logf.Close() }()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if resp, err := http.Get(ready); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("demo: %s did not become ready; see %s", name, logf.Name())
}

// close stops the stack's processes and removes what startDemoStack made: the schema,
// the Redis database's keys and the log folder. With keep, it first waits for Ctrl-C. A
// phase that failed (failed) keeps its logs, and says where.
func (st *demoStack) close(ctx context.Context, keep, failed bool, out io.Writer) {
	if st == nil {
		return
	}
	if keep && ctx.Err() == nil {
		fmt.Fprintf(out, "--keep: the stack stays up (dashboard %s/monitoring/); Ctrl-C stops it and removes its schema, Redis keys and logs\n", st.apiURL)
		<-ctx.Done()
	}
	stopProcs(st.procs)
	cctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if st.rdb != nil {
		st.rdb.Close()
	}
	if st.redisDB != nil {
		st.redisDB.Release(false)
	}
	if st.pool != nil {
		st.pool.Close()
	}
	if st.schema != nil {
		if err := st.schema.Drop(cctx); err != nil {
			fmt.Fprintf(out, "demo: schema %s left in place: %v\n", st.schema.Name, err)
		}
	}
	if st.logDir == "" {
		return
	}
	if failed {
		fmt.Fprintf(out, "demo: the processes' logs are kept in %s\n", st.logDir)
		return
	}
	os.RemoveAll(st.logDir)
}

// stopProcs sends every process of procs SIGTERM, then waits for each, killing one that
// has not exited 10 s later.
func stopProcs(procs []*exec.Cmd) {
	for _, p := range procs {
		p.Process.Signal(syscall.SIGTERM)
	}
	for _, p := range procs {
		done := make(chan struct{})
		go func() { p.Process.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			p.Process.Kill()
		}
	}
}

// scrape keeps the latest counters of every worker still answering (a killed worker's last
// scrape stays).
func (st *demoStack) scrape() {
	for i, u := range st.metrics {
		resp, err := http.Get(u)
		if err != nil {
			continue
		}
		vals := map[string]float64{}
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			for _, name := range []string{"idemq_ledger_events_total", "idemq_lock_events_total"} {
				if !strings.HasPrefix(line, name+"{") {
					continue
				}
				ev := line[strings.Index(line, `event="`)+7:]
				ev = ev[:strings.IndexByte(ev, '"')]
				v, _ := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
				vals[name+"/"+ev] += v
			}
		}
		resp.Body.Close()
		st.mu.Lock()
		st.lastScrape[i] = vals
		st.mu.Unlock()
	}
}

func (st *demoStack) counter(name string) float64 {
	st.mu.Lock()
	defer st.mu.Unlock()
	var sum float64
	for _, vals := range st.lastScrape {
		sum += vals[name]
	}
	return sum
}

// finished counts the jobs that are done: completed in the ledger (guarded), or with their
// effect present (unguarded: there is no ledger; a checkout's last effect is its receipt).
func (st *demoStack) finished(ctx context.Context, guarded bool, keys []string) (int, error) {
	var n int
	q := `SELECT count(*) FROM processed_jobs WHERE status = 'completed' AND idempotency_key = ANY($1)`
	if !guarded {
		q = `SELECT (SELECT count(DISTINCT order_id) FROM fakepay_charges WHERE 'charge:' || order_id = ANY($1))
		          + (SELECT count(DISTINCT reference) FROM wallet_entries WHERE 'debit:' || reference = ANY($1))
		          + (SELECT count(DISTINCT order_id) FROM fakepay_emails WHERE 'checkout:' || order_id = ANY($1))`
	}
	err := st.pool.QueryRow(ctx, q, keys).Scan(&n)
	return n, err
}

// nudgeEvery is how often the drain looks for jobs to enqueue again: with guards, once a
// worker was killed, as soon as its leases can have ended (a duplicate that comes early
// is answered busy and retried when the lease ends).
func nudgeEvery(guarded, killed bool) time.Duration {
	if guarded && killed {
		return 250 * time.Millisecond
	}
	return 3 * time.Second
}

// nudge re-delivers, under a new TaskID, the jobs a killed worker left behind, once
// nothing else is pending (with guards, deliveries waiting in the retry set for a lease to
// end do not count): asynq itself would redeliver them only after 60–120 s.
func (st *demoStack) nudge(ctx context.Context, client *asynq.Client, guarded bool, specs []outbox.Spec) (int, error) {
	info, err := asynq.NewInspectorFromRedisClient(st.rdb).GetQueueInfo(tasks.Queue)
	// With guards, a busy delivery waiting in the retry set for a lease the killed worker
	// held is no reason to wait: a duplicate is answered from the ledger.
	if err != nil || info.Pending+info.Scheduled > 0 || !guarded && info.Retry > 0 {
		return 0, nil
	}
	q := `SELECT i.idempotency_key FROM job_intents i LEFT JOIN processed_jobs p USING (idempotency_key)
		WHERE (p.idempotency_key IS NULL AND i.created_at < now() - interval '1 second')
		   OR (p.status = 'in_progress' AND p.locked_until < now())`
	if !guarded {
		q = `SELECT idempotency_key FROM job_intents i WHERE i.created_at < now() - interval '3 seconds'
		  AND NOT EXISTS (SELECT 1 FROM fakepay_charges c WHERE 'charge:' || c.order_id = i.idempotency_key)
		  AND NOT EXISTS (SELECT 1 FROM wallet_entries w WHERE 'debit:' || w.reference = i.idempotency_key)
		  AND NOT EXISTS (SELECT 1 FROM fakepay_emails e WHERE 'checkout:' || e.order_id = i.idempotency_key)`
	}
	rows, err := st.pool.Query(ctx, q)
	if err != nil {
		return 0, err
	}
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return 0, err
	}
	want := map[string]bool{}
	for _, k := range keys {
		want[k] = true
	}
	n := 0
	for _, s := range specs {
		if want[s.Key] {
			if _, err := client.EnqueueContext(ctx, s.Task(s.Key+"#nudge-"+randomHex(3), time.Now())); err == nil {
				n++
			}
		}
	}
	return n, nil
}

func (st *demoStack) measure(ctx context.Context, run *demoRun) error {
	st.scrape()
	run.cacheHits = st.counter("idemq_ledger_events_total/cache_hit")
	run.ledgerBusy = st.counter("idemq_ledger_events_total/busy")
	run.lockBusy = st.counter("idemq_lock_events_total/busy")
	if info, err := asynq.NewInspectorFromRedisClient(st.rdb).GetQueueInfo(tasks.Queue); err == nil {
		run.deliveries = info.ProcessedTotal
	}
	// A checkout's charge is a provider charge too, under its step key
	// (checkout:<order>#s/charge); the charges rows count payment:charge's alone.
	// An email is re-sent when a claim sent it but did not record the receipt step: its
	// fence is not the one the step's record holds (without guards nothing is recorded).
	return st.pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM fakepay_requests),
		(SELECT count(*) FROM fakepay_requests WHERE replayed),
		(SELECT count(*) FROM fakepay_charges WHERE idempotency_key LIKE 'charge:%'),
		(SELECT coalesce(max(n), 0) FROM (SELECT count(*) n FROM fakepay_charges WHERE idempotency_key LIKE 'charge:%' GROUP BY order_id) x),
		(SELECT count(DISTINCT order_id) FROM fakepay_charges WHERE idempotency_key LIKE 'charge:%'),
		(SELECT count(*) FROM wallet_entries),
		(SELECT coalesce(max(n), 0) FROM (SELECT count(*) n FROM wallet_entries GROUP BY reference) x),
		(SELECT count(DISTINCT reference) FROM wallet_entries),
		(SELECT count(*) FROM fakepay_charges WHERE idempotency_key LIKE 'checkout:%'),
		(SELECT coalesce(max(n), 0) FROM (SELECT count(*) n FROM fakepay_charges WHERE idempotency_key LIKE 'checkout:%' GROUP BY order_id) x),
		(SELECT count(*) FROM orders),
		(SELECT coalesce(max(n), 0) FROM (SELECT count(*) n FROM orders GROUP BY order_id) x),
		(SELECT count(DISTINCT order_id) FROM orders),
		(SELECT count(*) FROM fakepay_emails),
		(SELECT coalesce(max(n), 0) FROM (SELECT count(*) n FROM fakepay_emails GROUP BY order_id) x),
		(SELECT count(DISTINCT order_id) FROM fakepay_emails),
		(SELECT count(*) FROM fakepay_emails e WHERE EXISTS (SELECT 1 FROM processed_job_steps s
			WHERE s.idempotency_key = 'checkout:' || e.order_id AND s.step = 'receipt')
			AND NOT EXISTS (SELECT 1 FROM processed_job_steps s
			WHERE s.idempotency_key = 'checkout:' || e.order_id AND s.step = 'receipt' AND s.fence = e.fence))`).Scan(
		&run.providerRequests, &run.providerReplays, &run.charges, &run.chargeMax, &run.chargeOrders,
		&run.entries, &run.entryMax, &run.entryRefs,
		&run.checkoutCharges, &run.checkoutChargeMax, &run.orderRows, &run.orderRowMax, &run.checkouts,
		&run.emails, &run.emailMax, &run.emailed, &run.resent)
}

func printDemoTable(out io.Writer, runs []*demoRun) {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	header := "\t"
	for _, r := range runs {
		header += phaseName(r.guarded) + "\t"
	}
	fmt.Fprintln(tw, header)
	row := func(label string, f func(r *demoRun) string) {
		line := label + "\t"
		for _, r := range runs {
			line += f(r) + "\t"
		}
		fmt.Fprintln(tw, line)
	}
	num := func(v float64) string { return strconv.FormatFloat(math.Round(v), 'f', 0, 64) }
	row("API requests", func(r *demoRun) string { return num(float64(r.requests)) })
	row("  accepted (202)", func(r *demoRun) string { return num(float64(r.accepted)) })
	row("  replayed (same Idempotency-Key, same answer)", func(r *demoRun) string { return num(float64(r.replayed)) })
	row("  suppressed at enqueue (200 duplicate)", func(r *demoRun) string { return num(float64(r.duplicates)) })
	row("  refused while in flight (409)", func(r *demoRun) string { return num(float64(r.conflict)) })
	row("duplicate deliveries sent straight to asynq", func(r *demoRun) string { return num(float64(r.directDups + r.nudges)) })
	row("deliveries processed by workers", func(r *demoRun) string { return num(float64(r.deliveries)) })
	row("  suppressed by lock (busy, retried)", func(r *demoRun) string { return guardedOnly(r, num(r.lockBusy)) })
	row("  suppressed by ledger (cached result)", func(r *demoRun) string { return guardedOnly(r, num(r.cacheHits)) })
	row("  held off by a live lease (busy, retried)", func(r *demoRun) string { return guardedOnly(r, num(r.ledgerBusy)) })
	row("provider requests", func(r *demoRun) string { return num(float64(r.providerRequests)) })
	row("  suppressed by provider key (replayed)", func(r *demoRun) string { return num(float64(r.providerReplays)) })
	row("charges made / orders", func(r *demoRun) string { return fmt.Sprintf("%d / %d", r.charges, r.chargeOrders) })
	row("  most charges for one order", func(r *demoRun) string { return num(float64(r.chargeMax)) })
	row("wallet entries / references", func(r *demoRun) string { return fmt.Sprintf("%d / %d", r.entries, r.entryRefs) })
	row("  most entries for one reference", func(r *demoRun) string { return num(float64(r.entryMax)) })
	row("checkout charges / checkouts", func(r *demoRun) string { return fmt.Sprintf("%d / %d", r.checkoutCharges, r.checkouts) })
	row("  most charges for one checkout", func(r *demoRun) string { return num(float64(r.checkoutChargeMax)) })
	row("order rows / checkouts", func(r *demoRun) string { return fmt.Sprintf("%d / %d", r.orderRows, r.checkouts) })
	row("  most order rows for one checkout", func(r *demoRun) string { return num(float64(r.orderRowMax)) })
	row("receipt emails / checkouts", func(r *demoRun) string { return fmt.Sprintf("%d / %d", r.emails, r.emailed) })
	row("  most emails for one checkout", func(r *demoRun) string { return num(float64(r.emailMax)) })
	row("  re-sent (the sender stopped before its record)", func(r *demoRun) string { return guardedOnly(r, num(float64(r.resent))) })
	row(fmt.Sprintf("periodic ticks (%s, %d schedulers) / expected", demoTickEvery, demoSchedulers), func(r *demoRun) string {
		return fmt.Sprintf("%d / %d", r.ticks.enqueued, r.ticks.expected)
	})
	row("  settlements / ticks settled", func(r *demoRun) string { return fmt.Sprintf("%d / %d", r.ticks.settlements, r.ticks.settled) })
	row("  most settlements for one tick", func(r *demoRun) string { return num(float64(r.ticks.most)) })
	row("jobs never finished", func(r *demoRun) string { return num(float64(r.incomplete)) })
	row("worker SIGKILLed mid-flight", func(r *demoRun) string { return fmt.Sprint(r.killed) })
	row("elapsed", func(r *demoRun) string { return r.elapsed.Round(100 * time.Millisecond).String() })
	tw.Flush()
}

func guardedOnly(r *demoRun, v string) string {
	if !r.guarded {
		return "-"
	}
	return v
}

// migrateDSN applies the migrations, the example's too, to pool's schema.
func migrateDSN(ctx context.Context, pool *pgxpool.Pool) error {
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	if _, err := migrations.Up(ctx, db); err != nil {
		return err
	}
	_, err := migrations.UpExample(ctx, db)
	return err
}

// isTerminal reports whether w is a terminal (progress then rewrites one line).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
