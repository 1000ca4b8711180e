//go:build faults

package faults

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/internal/localserver"
	"github.com/idemq/idemq/internal/testenv"
)

// binary is the idemq binary, built once per test run by TestMain.
var binary string

func TestMain(m *testing.M) { testenv.RunWithIdemq(m, &binary) }

var errRunning = errors.New("already running")

// errParked is start's answer for a parked slot.
var errParked = errors.New("parked")

// proc is one idemq process slot (fakepay, api or a worker); it can be started again after
// it exits. Its output is appended to one log file across incarnations.
type proc struct {
	name string
	env  []string
	args []string
	log  string
	// exe is the binary it runs (empty: binary, this build's); set it only under mu.
	exe string
	// parked: the slot is not started, by the nemesis or anyone, until unparked.
	parked bool

	mu       sync.Mutex
	cmd      *exec.Cmd
	done     chan struct{}
	expected bool // the next exit was caused by the suite
	stopped  bool // SIGSTOPped by the suite
}

func (p *proc) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done != nil {
		select {
		case <-p.done:
		default:
			return errRunning // restarted by someone else
		}
	}
	f, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	if p.parked {
		return errParked
	}
	cmd := exec.Command(cmp.Or(p.exe, binary), p.args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, p.env...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); f.Close(); close(done) }()
	p.cmd, p.done, p.expected, p.stopped = cmd, done, false, false
	return nil
}

// signal sends sig to the running process; expectExit marks the exit as the suite's doing.
func (p *proc) signal(sig syscall.Signal, expectExit bool) (done chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return nil
	}
	if expectExit {
		p.expected = true
	}
	switch sig {
	case syscall.SIGSTOP:
		p.stopped = true
	case syscall.SIGCONT:
		p.stopped = false
	}
	p.cmd.Process.Signal(sig)
	return p.done
}

func (p *proc) doneCh() chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.done
}

func (p *proc) tail(n int) string {
	b, _ := os.ReadFile(p.log)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// worker is a worker or scheduler slot with its metrics: the latest scrape of the running
// process and the sum of the last scrapes of the processes that exited.
type worker struct {
	*proc
	i          int
	metricsURL string

	mmu  sync.Mutex
	live map[string]float64
	dead map[string]float64
}

var eventLabel = regexp.MustCompile(`event="([^"]+)"`)

// scrape reads the process's idemq_ledger_events_total and idemq_lock_events_total, summed
// over task types, as "ledger:<event>" and "lock:<event>", and a scheduler's
// idemq_schedule_ticks_total, summed over entries, as "schedule:<event>".
func (w *worker) scrape() {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(w.metricsURL)
	if err != nil {
		return
	}
	defer resp.Body.Close()
	got := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		var prefix string
		switch {
		case strings.HasPrefix(line, "idemq_ledger_events_total{"):
			prefix = "ledger:"
		case strings.HasPrefix(line, "idemq_lock_events_total{"):
			prefix = "lock:"
		case strings.HasPrefix(line, "idemq_schedule_ticks_total{"):
			prefix = "schedule:"
		default:
			continue
		}
		m := eventLabel.FindStringSubmatch(line)
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if m == nil || err != nil {
			continue
		}
		got[prefix+m[1]] += v
	}
	if sc.Err() != nil {
		return
	}
	w.mmu.Lock()
	w.live = got
	w.mmu.Unlock()
}

// fold moves the last scrape of an exited process into the dead sum.
func (w *worker) fold() {
	w.mmu.Lock()
	defer w.mmu.Unlock()
	if w.dead == nil {
		w.dead = map[string]float64{}
	}
	for k, v := range w.live {
		w.dead[k] += v
	}
	w.live = nil
}

func (w *worker) counters() map[string]float64 {
	w.mmu.Lock()
	defer w.mmu.Unlock()
	out := map[string]float64{}
	for k, v := range w.dead {
		out[k] += v
	}
	for k, v := range w.live {
		out[k] += v
	}
	return out
}

// cluster is one private stack: Postgres, Redis, fakepay, the API and the workers.
type cluster struct {
	t   *testing.T
	dir string
	// pg is the Postgres primary; with a standby, standby is the other node, and a
	// promotion swaps the two. Only the nemesis and then heal (after it) change or read
	// them, one after the other: no lock. dbURL is every process's DATABASE_URL and
	// pool's: pg's URL, or with a standby the multi-host URL naming both nodes.
	pg      *localserver.Postgres
	standby *localserver.Postgres
	dbURL   string
	rd      *localserver.Redis     // the master, the node a Redis fault kills
	sg      *localserver.Sentinels // with sentinel: rd is its master now
	pool    *pgxpool.Pool
	rdb     *redis.Client
	client  *asynq.Client
	insp    *asynq.Inspector
	apiURL  string
	// apis are the APIs the workload sends to (apiURL, and with a previous release this
	// build's api too, once it runs).
	apis    atomic.Pointer[[]string]
	fakepay *proc
	api     *proc
	extra   []*proc // started by the run (the mixed run's second api)
	workers []*worker
	// schedulers are the `idemq scheduler` replicas; schedFrom is when they were first
	// started, schedTo when stopSchedulers stopped them (zero until then).
	schedulers         []*worker
	schedFrom, schedTo time.Time
	hist               *history
	// badEnqueued is when enqueueBad sent the bad payloads (after the heal).
	badEnqueued time.Time

	closing   atomic.Bool
	redisUp   atomic.Bool
	pgUp      atomic.Bool
	standbyUp atomic.Bool // standby streams from pg, synchronously
	scrapeWG  sync.WaitGroup
}

// clusterConfig chooses what differs between runs.
type clusterConfig struct {
	mode localserver.Persistence
	// sentinel runs Redis as a master, a replica and three Sentinels (mode is then
	// ignored: each keeps nothing across a restart); REDIS_URL names them, and a Redis
	// fault is a failover.
	sentinel bool
	// pgStandby runs Postgres as a primary and a synchronous streaming standby; every
	// process reaches the primary through a multi-host URL naming both, and the nemesis
	// adds promotions.
	pgStandby bool
	workers   int
	honorKeys bool
	workerEnv []string // added after the defaults (later values win)
	// workerEnvAt is added after workerEnv for the worker of each index.
	workerEnvAt map[int][]string
	startAfter  int // workers with index >= startAfter are not started at first
	// previous is the previous release's binary: when set, the schema is migrated by it,
	// fakepay, the api and the workers below startAfter run it, and the workers from
	// startAfter on (this build) are parked until the run unparks them.
	previous string
	// schedulers is the number of `idemq scheduler` replicas, each running scheduleFile;
	// schedulerEnv is added after their defaults.
	schedulers   int
	schedulerEnv []string
}

// scheduleFile is the schedulers' schedule: one cheap entry, a settlement every 2 s. It
// sets max_retry: an entry's default is 0, no retry, and a delivery that meets Postgres
// down (stop_postgres) then archives its tick's job for good, a tick lost.
const scheduleFile = `entries:
  - name: settle-2s
    schedule: "@every 2s"
    task_type: wallet:settle
    payload: {period: 2s}
    max_retry: 5
`

const (
	lease      = 5 * time.Second
	fakepayMax = 3 * time.Second // IDEMQ_FAKEPAY_DELAY: provider latency 0..3 s
)

func startCluster(t *testing.T, cfg clusterConfig, hist *history) *cluster {
	t.Helper()
	c := &cluster{t: t, dir: t.TempDir(), hist: hist}
	keepLogs(t, c.dir)
	var err error
	if c.pg, err = localserver.StartPostgres(); err != nil {
		t.Fatalf("private postgres: %v", err)
	}
	// Each node is closed, whichever is primary by then.
	pg := c.pg
	t.Cleanup(func() { pg.Close() })
	c.dbURL = c.pg.URL
	if cfg.pgStandby {
		if c.standby, err = localserver.StartStandby(c.pg, true); err != nil {
			t.Fatalf("private postgres standby: %v", err)
		}
		standby := c.standby
		t.Cleanup(func() { standby.Close() })
		c.dbURL = localserver.MultiHostURL(c.pg, c.standby)
		c.standbyUp.Store(true)
	}
	redisURL := ""
	if cfg.sentinel {
		if c.sg, err = localserver.StartSentinels(); err != nil {
			t.Fatalf("private sentinels: %v", err)
		}
		t.Cleanup(c.sg.Close)
		c.rd, redisURL = c.sg.Master, c.sg.URL
		c.rdb = redis.NewFailoverClient(&redis.FailoverOptions{MasterName: localserver.MasterName, SentinelAddrs: c.sg.Addrs,
			DialTimeout: time.Second, ReadTimeout: 3 * time.Second, WriteTimeout: 3 * time.Second})
	} else {
		if c.rd, err = localserver.StartRedis(cfg.mode); err != nil {
			t.Fatalf("private redis: %v", err)
		}
		t.Cleanup(func() { c.rd.Close() })
		redisURL = c.rd.URL
		c.rdb = redis.NewClient(&redis.Options{Addr: c.rd.Addr, DialTimeout: time.Second, ReadTimeout: 3 * time.Second, WriteTimeout: 3 * time.Second})
	}
	t.Cleanup(func() { c.rdb.Close() })
	c.redisUp.Store(true)
	c.pgUp.Store(true)

	if out, err := runIdemqExe(cmp.Or(cfg.previous, binary), []string{"DATABASE_URL=" + c.dbURL}, "migrate"); err != nil {
		t.Fatalf("idemq migrate: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	pcfg, _ := pgxpool.ParseConfig(c.dbURL)
	pcfg.MaxConns = 12
	if c.pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.pool.Close)
	if _, err := c.pool.Exec(ctx, createExpected); err != nil {
		t.Fatalf("create the suite's table: %v", err)
	}
	c.client = asynq.NewClientFromRedisClient(c.rdb)
	c.insp = asynq.NewInspectorFromRedisClient(c.rdb)

	fpPort, _ := localserver.FreePort()
	fakepayURL := fmt.Sprintf("http://127.0.0.1:%d", fpPort)
	c.fakepay = &proc{name: "fakepay", args: []string{"fakepay"}, log: filepath.Join(c.dir, "fakepay.log"), env: []string{
		"DATABASE_URL=" + c.dbURL, fmt.Sprintf("IDEMQ_FAKEPAY_ADDR=127.0.0.1:%d", fpPort),
		fmt.Sprintf("IDEMQ_FAKEPAY_HONOR_KEYS=%t", cfg.honorKeys), "IDEMQ_FAKEPAY_DELAY=" + fakepayMax.String()}}
	apiPort, _ := localserver.FreePort()
	c.apiURL = fmt.Sprintf("http://127.0.0.1:%d", apiPort)
	c.api = &proc{name: "api", args: []string{"api"}, log: filepath.Join(c.dir, "api.log"), env: []string{
		"DATABASE_URL=" + c.dbURL, "REDIS_URL=" + redisURL, fmt.Sprintf("IDEMQ_HTTP_ADDR=127.0.0.1:%d", apiPort),
		"IDEMQ_RECONCILE_GRACE=20s"}}
	c.apis.Store(&[]string{c.apiURL})
	for _, p := range []*proc{c.fakepay, c.api} {
		p.exe = cfg.previous
		if err := p.start(); err != nil {
			t.Fatal(err)
		}
	}
	testenv.WaitHTTP(t, fakepayURL+"/healthz", 30*time.Second)
	testenv.WaitHTTP(t, c.apiURL+"/healthz", 30*time.Second)

	workerEnv := append([]string{
		// application_name lets the nemesis terminate the workers' connections only.
		"DATABASE_URL=" + withParam(c.dbURL, "application_name=idemq-worker"),
		"REDIS_URL=" + redisURL, "IDEMQ_FAKEPAY_URL=" + fakepayURL,
		"IDEMQ_CONCURRENCY=4", "IDEMQ_LEASE=" + lease.String(), "IDEMQ_LOCK_TTL=5s", "IDEMQ_SHUTDOWN_TIMEOUT=8s",
		"IDEMQ_RECONCILE_GRACE=20s", "IDEMQ_LOG_LEVEL=info",
	}, cfg.workerEnv...)
	for i := range cfg.workers {
		port, _ := localserver.FreePort()
		w := &worker{i: i, metricsURL: fmt.Sprintf("http://127.0.0.1:%d/metrics", port), proc: &proc{
			name: fmt.Sprintf("worker%d", i), args: []string{"worker"}, log: filepath.Join(c.dir, fmt.Sprintf("worker%d.log", i)),
			env: append(append([]string{fmt.Sprintf("IDEMQ_METRICS_ADDR=127.0.0.1:%d", port)}, workerEnv...), cfg.workerEnvAt[i]...)}}
		c.workers = append(c.workers, w)
		if cfg.startAfter == 0 || i < cfg.startAfter {
			w.exe = cfg.previous
			c.startWorker(w)
		} else if cfg.previous != "" {
			w.parked = true
		}
	}
	for _, w := range c.workers {
		if w.doneCh() != nil {
			testenv.WaitHTTP(t, strings.TrimSuffix(w.metricsURL, "/metrics")+"/readyz", 30*time.Second)
		}
	}
	if cfg.schedulers > 0 {
		file := filepath.Join(c.dir, "schedule.yaml")
		if err := os.WriteFile(file, []byte(scheduleFile), 0o644); err != nil {
			t.Fatal(err)
		}
		c.schedFrom = time.Now()
		for i := range cfg.schedulers {
			port, _ := localserver.FreePort()
			s := &worker{i: i, metricsURL: fmt.Sprintf("http://127.0.0.1:%d/metrics", port), proc: &proc{
				name: fmt.Sprintf("scheduler%d", i), args: []string{"scheduler"}, log: filepath.Join(c.dir, fmt.Sprintf("scheduler%d.log", i)),
				env: append([]string{fmt.Sprintf("IDEMQ_METRICS_ADDR=127.0.0.1:%d", port),
					"DATABASE_URL=" + withParam(c.dbURL, "application_name=idemq-scheduler"), "REDIS_URL=" + redisURL,
					"IDEMQ_SCHEDULE_FILE=" + file, "IDEMQ_LOG_LEVEL=info"}, cfg.schedulerEnv...)}}
			c.schedulers = append(c.schedulers, s)
			c.startScheduler(s)
		}
		for _, s := range c.schedulers {
			testenv.WaitHTTP(t, strings.TrimSuffix(s.metricsURL, "/metrics")+"/readyz", 30*time.Second)
		}
	}
	c.scrapeWG.Add(1)
	go c.scrapeLoop()
	t.Cleanup(func() {
		c.closing.Store(true)
		c.scrapeWG.Wait()
		for _, p := range c.procs() {
			if d := p.signal(syscall.SIGKILL, true); d != nil {
				<-d
			}
		}
		if t.Failed() {
			for _, p := range c.procs() {
				t.Logf("--- %s log (tail) ---\n%s", p.name, p.tail(2500))
			}
		}
	})
	return c
}

func (c *cluster) procs() []*proc {
	ps := append([]*proc{c.fakepay, c.api}, c.extra...)
	for _, w := range append(slices.Clone(c.workers), c.schedulers...) {
		ps = append(ps, w.proc)
	}
	return ps
}

// startScheduler starts s and watches it like startWorker: an exit the suite did not
// cause is recorded (scheduler_exit) and the scheduler is restarted.
func (c *cluster) startScheduler(s *worker) {
	if err := s.start(); errors.Is(err, errRunning) {
		return
	} else if err != nil {
		c.t.Errorf("start %s: %v", s.name, err)
		return
	}
	done := s.doneCh()
	go func() {
		<-done
		s.fold()
		s.mu.Lock()
		expected := s.expected
		s.mu.Unlock()
		if expected || c.closing.Load() {
			return
		}
		c.hist.note("scheduler_exit", s.name, "exited on its own; restarted")
		time.Sleep(300 * time.Millisecond)
		if !c.closing.Load() {
			c.startScheduler(s)
		}
	}()
}

// stopSchedulers scrapes the schedulers, then stops them (SIGTERM; SIGKILL after 10 s)
// and records when: the end of the ticks the checker expects.
func (c *cluster) stopSchedulers() {
	if len(c.schedulers) == 0 {
		return
	}
	var dones []chan struct{}
	for _, s := range c.schedulers {
		s.signal(syscall.SIGCONT, false)
		s.scrape()
	}
	c.schedTo = time.Now()
	for _, s := range c.schedulers {
		if d := s.signal(syscall.SIGTERM, true); d != nil {
			dones = append(dones, d)
		}
	}
	for i, d := range dones {
		select {
		case <-d:
		case <-time.After(10 * time.Second):
			c.schedulers[i].signal(syscall.SIGKILL, true)
			<-d
			c.hist.note("term_timeout", c.schedulers[i].name, "did not exit within 10 s of SIGTERM; killed")
		}
	}
}

// schedCounters sums the schedulers' counters (last scrape of each process).
func (c *cluster) schedCounters() map[string]float64 {
	out := map[string]float64{}
	for _, s := range c.schedulers {
		for k, v := range s.counters() {
			out[k] += v
		}
	}
	return out
}

// startWorker starts w and watches it: an exit the suite did not cause (a fault point's
// SIGKILL) is recorded as a kill and the worker is restarted.
func (c *cluster) startWorker(w *worker) {
	if err := w.start(); errors.Is(err, errRunning) || errors.Is(err, errParked) {
		return
	} else if err != nil {
		c.t.Errorf("start %s: %v", w.name, err)
		return
	}
	done := w.doneCh()
	go func() {
		<-done
		w.fold()
		w.mu.Lock()
		expected := w.expected
		w.mu.Unlock()
		if expected || c.closing.Load() {
			return
		}
		c.hist.nemesis("fault_point_crash", w.name)
		go c.trackHeld(time.Now())
		time.Sleep(300 * time.Millisecond)
		if !c.closing.Load() {
			c.startWorker(w)
		}
	}()
}

func (c *cluster) scrapeLoop() {
	defer c.scrapeWG.Done()
	for !c.closing.Load() {
		for _, w := range append(slices.Clone(c.workers), c.schedulers...) {
			w.mu.Lock()
			running := w.cmd != nil && !w.stopped
			w.mu.Unlock()
			if running {
				w.scrape()
			}
		}
		time.Sleep(2 * time.Second)
	}
}

// counters sums the workers' counters (last scrape of each process).
func (c *cluster) counters() map[string]float64 {
	out := map[string]float64{}
	for _, w := range c.workers {
		w.scrape()
		for k, v := range w.counters() {
			out[k] += v
		}
	}
	return out
}

func runIdemq(env []string, args ...string) (string, error) {
	return runIdemqExe(binary, env, args...)
}

// runIdemqExe is runIdemq with the binary exe.
func runIdemqExe(exe string, env []string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, exe, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// withParam adds the query parameter kv ("name=value") to the URL u.
func withParam(u, kv string) string {
	if strings.Contains(u, "?") {
		return u + "&" + kv
	}
	return u + "?" + kv
}

// keepLogs copies dir's process logs to $IDEMQ_FAULTS_KEEP/<test> when the test fails
// (registered after t.TempDir made dir, it runs before dir is removed).
func keepLogs(t *testing.T, dir string) {
	keep := os.Getenv("IDEMQ_FAULTS_KEEP")
	if keep == "" {
		return
	}
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		dst := filepath.Join(keep, strings.NewReplacer("/", "_", "=", "-").Replace(t.Name()))
		if err := os.CopyFS(dst, os.DirFS(dir)); err != nil {
			t.Logf("keep the logs in %s: %v", dst, err)
			return
		}
		t.Logf("logs kept in %s", dst)
	})
}
