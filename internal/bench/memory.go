package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Memory mode runs each configuration's asynq server in a process of its own (this
// binary again, as `idemq-bench -memory-child`), so that its resident set is its own:
// this process enqueues MemoryTasks no-op tasks in chunks while it reads the child's
// VmRSS every memorySampleEvery and its VmHWM (peak) at the end of the load.
const (
	memorySampleEvery = 250 * time.Millisecond
	// memoryWarmup is the fraction of the tasks after which the resident set counts as
	// warmed up; the slope is fitted over the samples from there on.
	memoryWarmup = 0.10
	// memoryStall fails a child that processes nothing for this long.
	memoryStall = time.Minute
)

// MemoryReport is memory mode's result.
type MemoryReport struct {
	Tasks         int    `json:"tasks"`
	Concurrency   int    `json:"concurrency"`
	PoolPerServer int    `json:"pool_per_server"` // Postgres connections of the full stack's child
	Chunk         int    `json:"enqueue_chunk"`   // tasks enqueued at a time; at most two chunks wait in the queue
	Warmup        string `json:"warmup"`
	// Results, one per configuration, in the order run.
	Results []MemoryResult `json:"results"`
}

// MemoryResult is one configuration's child process over one run.
type MemoryResult struct {
	Config         string  `json:"config"`
	Name           string  `json:"name"`
	Tasks          int     `json:"tasks"`
	Errors         int     `json:"errors"`
	Seconds        float64 `json:"seconds"`
	TasksPerSecond float64 `json:"tasks_per_s"`
	// Resident set (bytes) when the server had started, at the first sample after the
	// warm-up, at the end of the load, and its peak (VmHWM) at the end of the load.
	RSSReady  int64   `json:"rss_ready_bytes"`
	RSSWarm   int64   `json:"rss_after_warmup_bytes"`
	RSSEnd    int64   `json:"rss_end_bytes"`
	PeakRSS   int64   `json:"peak_rss_bytes"`
	PeakRatio float64 `json:"peak_rss_ratio"` // ÷ bare asynq's peak (0 without A)
	// Least-squares slopes over the samples after the warm-up, bytes per 1000 tasks
	// processed: of the resident set and of the Go heap live at the last collection.
	RSSSlope float64 `json:"rss_slope_bytes_per_1000_tasks"`
	// RSSSlopeLate is the RSS slope over the second half of the tasks only: a resident
	// set still settling after the warm-up tilts RSSSlope, growth per task tilts both.
	RSSSlopeLate  float64 `json:"rss_slope_second_half_bytes_per_1000_tasks"`
	LiveHeapSlope float64 `json:"live_heap_slope_bytes_per_1000_tasks"`
	FitSamples    int     `json:"fit_samples"`
	LiveHeapWarm  uint64  `json:"live_heap_after_warmup_bytes"`
	LiveHeapEnd   uint64  `json:"live_heap_end_bytes"`
	// The child's Go heap when the load ended (runtime.MemStats).
	GoHeap childStats `json:"go_heap_at_end"`
	// Heap profiles, when asked for: at the end of the load and at the end of the
	// warm-up (the child forces a collection for it, so profiled runs are perturbed there).
	Memprofile     string      `json:"memprofile,omitempty"`
	MemprofileWarm string      `json:"memprofile_warm,omitempty"`
	Samples        []MemSample `json:"samples"`
}

// MemSample is one reading of the child.
type MemSample struct {
	Seconds  float64 `json:"s"`
	Tasks    int64   `json:"tasks"`
	RSS      int64   `json:"rss"`
	LiveHeap uint64  `json:"live_heap"`
}

// memoryChild is a started child and what its stdout has said so far.
type memoryChild struct {
	cmd      *exec.Cmd
	ready    chan struct{}
	exited   chan struct{}
	waitErr  error
	done     atomic.Int64
	errs     atomic.Int64
	liveHeap atomic.Uint64
	stats    atomic.Pointer[childStats]
	stderr   *tailBuffer
}

// RunMemory runs memory mode: opt.MemoryConfigs one after the other, each in a child
// process serving opt.MemoryTasks no-op tasks. Progress lines go to progress.
func RunMemory(ctx context.Context, opt Options, progress io.Writer) (*Report, error) {
	opt.defaults()
	rep := newReport(opt)
	exe := opt.Self
	if exe == "" {
		return nil, errors.New("bench: memory mode re-runs this binary: its path is unknown")
	}
	if _, err := readStatus(os.Getpid()); err != nil {
		return nil, fmt.Errorf("bench: memory mode reads /proc/<pid>/status: %w", err)
	}
	e, err := setup(ctx, opt)
	if err != nil {
		return nil, err
	}
	defer e.close()

	n := opt.MemoryTasks
	m := &MemoryReport{Tasks: n, Concurrency: opt.Concurrency, PoolPerServer: int(e.poolSize(1)),
		Chunk: min(max(n/20, 100), 5000), Warmup: fmt.Sprintf("first %.0f%% of the tasks", memoryWarmup*100)}
	rep.Memory = m
	start := time.Now()
	for _, config := range opt.MemoryConfigs {
		r, err := e.memoryRun(ctx, exe, config, m, opt.MemProfileDir, progress)
		if err != nil {
			return nil, err
		}
		m.Results = append(m.Results, r)
	}
	var bare int64
	for _, r := range m.Results {
		if r.Config == ConfigBare {
			bare = r.PeakRSS
		}
	}
	for i := range m.Results {
		if bare > 0 {
			m.Results[i].PeakRatio = float64(m.Results[i].PeakRSS) / float64(bare)
		}
	}
	rep.WallSeconds = time.Since(start).Seconds()
	return rep, nil
}

// memoryRun runs one configuration's child over m.Tasks tasks.
func (e *env) memoryRun(ctx context.Context, exe, config string, m *MemoryReport, profileDir string, progress io.Writer) (MemoryResult, error) {
	r := MemoryResult{Config: config, Name: ConfigNames[config], Tasks: m.Tasks}
	if err := e.reset(ctx); err != nil {
		return r, err
	}
	args := []string{childFlag, "-config", config, "-concurrency", strconv.Itoa(m.Concurrency), "-pool", strconv.Itoa(m.PoolPerServer)}
	if profileDir != "" {
		r.Memprofile = filepath.Join(profileDir, "memory-"+config+".pprof")
		r.MemprofileWarm = warmProfile(r.Memprofile)
		args = append(args, "-memprofile", r.Memprofile)
	}
	c, err := startChild(ctx, exe, args, e.redisDB.URL, e.dsn)
	if err != nil {
		return r, err
	}
	defer c.kill()
	fail := func(format string, a ...any) (MemoryResult, error) {
		return r, fmt.Errorf("bench: memory %s: %s (child stderr: %q)", config, fmt.Sprintf(format, a...), c.stderr.String())
	}
	select {
	case <-c.ready:
	case <-c.exited:
		return fail("child exited before it was ready: %v", c.waitErr)
	case <-time.After(time.Minute):
		return fail("child not ready after a minute")
	case <-ctx.Done():
		return r, ctx.Err()
	}
	pid := c.cmd.Process.Pid
	st, err := readStatus(pid)
	if err != nil {
		return fail("%v", err)
	}
	r.RSSReady = st.rss

	// The enqueuer keeps at most two chunks waiting.
	prefix := fmt.Sprintf("M%s%d-%s", config, e.measured.Add(1), randomHex(2))
	enqCtx, stopEnq := context.WithCancel(ctx)
	defer stopEnq()
	enqErr := make(chan error, 1)
	go func() {
		for next := 0; next < m.Tasks; {
			for int64(next)-c.done.Load() > int64(m.Chunk) {
				select {
				case <-enqCtx.Done():
					enqErr <- nil
					return
				case <-time.After(10 * time.Millisecond):
				}
			}
			to := min(next+m.Chunk, m.Tasks)
			if err := e.enqueueRange(enqCtx, noopWorkload("noop", 0), prefix, next, to); err != nil {
				enqErr <- err
				return
			}
			next = to
		}
		enqErr <- nil
	}()

	began := time.Now()
	tick := time.NewTicker(memorySampleEvery)
	defer tick.Stop()
	lastDone, lastChange := int64(0), time.Now()
	warm, warmProfiled := int64(memoryWarmup*float64(m.Tasks)), false
	sample := func() error {
		st, err := readStatus(pid)
		if err != nil {
			return err
		}
		r.Samples = append(r.Samples, MemSample{Seconds: time.Since(began).Seconds(), Tasks: c.done.Load(), RSS: st.rss, LiveHeap: c.liveHeap.Load()})
		return nil
	}
	for c.done.Load() < int64(m.Tasks) {
		select {
		case <-tick.C:
		case err := <-enqErr:
			if err != nil {
				return fail("%v", err)
			}
			continue
		case <-c.exited:
			return fail("child exited during the load: %v", c.waitErr)
		case <-ctx.Done():
			return r, ctx.Err()
		}
		if err := sample(); err != nil {
			return fail("%v", err)
		}
		if r.Memprofile != "" && !warmProfiled && c.done.Load() >= warm {
			// The warm-up profile (after a collection the child forces).
			c.cmd.Process.Signal(syscall.SIGUSR1)
			warmProfiled = true
		}
		if d := c.done.Load(); d != lastDone {
			lastDone, lastChange = d, time.Now()
		} else if time.Since(lastChange) > memoryStall {
			return fail("no task done for %s at %d of %d (%d errors)", memoryStall, d, m.Tasks, c.errs.Load())
		}
		if c.errs.Load() > int64(m.Tasks)+10 {
			return fail("%d errors", c.errs.Load())
		}
	}
	r.Seconds = time.Since(began).Seconds()
	r.TasksPerSecond = float64(m.Tasks) / r.Seconds
	if err := sample(); err != nil {
		return fail("%v", err)
	}
	st, err = readStatus(pid)
	if err != nil {
		return fail("%v", err)
	}
	r.PeakRSS, r.RSSEnd = st.hwm, st.rss
	r.Errors = int(c.errs.Load())

	// Stop the child: it reports its heap, writes the profile and shuts asynq down.
	c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.exited:
	case <-time.After(30 * time.Second):
		return fail("child still running 30s after SIGTERM")
	}
	if c.waitErr != nil {
		return fail("child: %v", c.waitErr)
	}
	if s := c.stats.Load(); s != nil {
		r.GoHeap = *s
	} else {
		return fail("child exited without its memstats line")
	}
	r.fit(warm)
	fmt.Fprintf(progress, "memory %s %-18s n=%d %6.0f tasks/s  RSS ready %s, after warm-up %s, end %s, peak %s  slope %+.0f B/1000 tasks (second half %+.0f)  live heap %s → %s\n",
		config, r.Name, m.Tasks, r.TasksPerSecond, mib(r.RSSReady), mib(r.RSSWarm), mib(r.RSSEnd), mib(r.PeakRSS), r.RSSSlope, r.RSSSlopeLate, mib(int64(r.LiveHeapWarm)), mib(int64(r.LiveHeapEnd)))
	return r, nil
}

// fit sets the figures after the warm-up: the first sample at or past warm tasks, the
// last, and least-squares slopes of RSS and live heap against tasks processed.
func (r *MemoryResult) fit(warm int64) {
	var xs, rss, heap, lateX, lateRSS []float64
	for _, s := range r.Samples {
		if s.Tasks < warm {
			continue
		}
		if 2*s.Tasks >= int64(r.Tasks) {
			lateX = append(lateX, float64(s.Tasks))
			lateRSS = append(lateRSS, float64(s.RSS))
		}
		if len(xs) == 0 {
			r.RSSWarm, r.LiveHeapWarm = s.RSS, s.LiveHeap
		}
		xs = append(xs, float64(s.Tasks))
		rss = append(rss, float64(s.RSS))
		heap = append(heap, float64(s.LiveHeap))
	}
	if n := len(r.Samples); n > 0 {
		r.LiveHeapEnd = r.Samples[n-1].LiveHeap
	}
	r.FitSamples = len(xs)
	r.RSSSlope = 1000 * slope(xs, rss)
	r.RSSSlopeLate = 1000 * slope(lateX, lateRSS)
	r.LiveHeapSlope = 1000 * slope(xs, heap)
}

// slope is the least-squares slope of ys over xs (0 when xs do not vary).
func slope(xs, ys []float64) float64 {
	n := float64(len(xs))
	if n < 2 {
		return 0
	}
	var sx, sy float64
	for i := range xs {
		sx += xs[i]
		sy += ys[i]
	}
	mx, my := sx/n, sy/n
	var sxy, sxx float64
	for i := range xs {
		sxy += (xs[i] - mx) * (ys[i] - my)
		sxx += (xs[i] - mx) * (xs[i] - mx)
	}
	if sxx == 0 {
		return 0
	}
	return sxy / sxx
}

// startChild starts exe with args, its Redis and Postgres in the environment, and reads
// its stdout. The child dies with this process (see childAttr) and on kill.
func startChild(ctx context.Context, exe string, args []string, redisURL, databaseURL string) (*memoryChild, error) {
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), "REDIS_URL="+redisURL, "DATABASE_URL="+databaseURL, ChildEnv+"=1")
	cmd.SysProcAttr = childAttr()
	c := &memoryChild{cmd: cmd, ready: make(chan struct{}), exited: make(chan struct{}), stderr: &tailBuffer{max: 4096}}
	cmd.Stderr = c.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("bench: start memory child: %w", err)
	}
	var readyOnce sync.Once
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			kind, rest, _ := strings.Cut(sc.Text(), " ")
			switch kind {
			case "ready":
				readyOnce.Do(func() { close(c.ready) })
			case "progress":
				var d, e int64
				var h uint64
				if _, err := fmt.Sscan(rest, &d, &e, &h); err == nil {
					c.done.Store(d)
					c.errs.Store(e)
					c.liveHeap.Store(h)
				}
			case "memstats":
				var s childStats
				if json.Unmarshal([]byte(rest), &s) == nil {
					c.stats.Store(&s)
				}
			}
		}
		c.waitErr = cmd.Wait()
		close(c.exited)
	}()
	return c, nil
}

// kill ends the child if it still runs and waits for it.
func (c *memoryChild) kill() {
	select {
	case <-c.exited:
	default:
		c.cmd.Process.Kill()
		<-c.exited
	}
}

// procStatus is what memory mode reads of /proc/<pid>/status, in bytes.
type procStatus struct{ rss, hwm int64 }

func readStatus(pid int) (procStatus, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return procStatus{}, err
	}
	var st procStatus
	for _, line := range bytes.Split(b, []byte("\n")) {
		name, val, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			continue
		}
		var dst *int64
		switch string(name) {
		case "VmRSS":
			dst = &st.rss
		case "VmHWM":
			dst = &st.hwm
		default:
			continue
		}
		f := strings.Fields(string(val)) // "12345 kB"
		if len(f) != 2 || f[1] != "kB" {
			return st, fmt.Errorf("bench: /proc/%d/status: unreadable %s", pid, name)
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return st, fmt.Errorf("bench: /proc/%d/status: unreadable %s", pid, name)
		}
		*dst = kb * 1024
	}
	if st.rss == 0 || st.hwm == 0 {
		return st, fmt.Errorf("bench: /proc/%d/status has no VmRSS/VmHWM", pid)
	}
	return st, nil
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	b   []byte
	max int
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = append(t.b[:0:0], t.b[len(t.b)-t.max:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }
