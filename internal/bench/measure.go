package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/http/httptest"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/handlers"
	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/idempotency/server"
	"github.com/idemq/idemq/internal/dial"
	"github.com/idemq/idemq/internal/fakepay"
	"github.com/idemq/idemq/internal/localserver"
	"github.com/idemq/idemq/lock"
	"github.com/idemq/idemq/migrations"
	"github.com/idemq/idemq/tasks"
)

// env is what a run sets up once: a migrated Postgres schema of its own, a leased empty
// Redis database, the in-process provider.
type env struct {
	opt      Options
	schema   *localserver.Schema
	dsn      string
	appName  string
	redisDB  *localserver.RedisDB
	rdb      *redis.Client // enqueues and empties the database between measurements
	admin    *pgxpool.Pool // truncates between measurements, lists backends for CPU
	fpPool   *pgxpool.Pool
	fakepay  *httptest.Server
	charger  *handlers.Charger
	probe    *cpuProbe
	measured atomic.Int64
}

func setup(ctx context.Context, opt Options) (_ *env, err error) {
	e := &env{opt: opt}
	defer func() {
		if err != nil {
			e.close()
		}
	}()
	suffix := randomHex(4)
	e.appName = "idemq-bench-" + suffix
	schema, err := localserver.CreateSchema(ctx, opt.DatabaseURL, "idemq_bench_"+suffix, map[string]string{"application_name": e.appName})
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	e.schema, e.dsn = schema, schema.URL
	if e.admin, err = e.openPool(ctx, 2); err != nil {
		return nil, err
	}
	// Binaries compared side by side (drain or API mode) each migrate the schema first, in the order given
	// (put the oldest first): a binary from before idemq's own version tables checks
	// goose's, which only its own migrate writes; the migrations below then carry the
	// schema over. Soak mode's one binary migrates it too (Options.binaryMigrates), as a
	// deployment of it would.
	binaries := opt.DrainBinaries
	if len(opt.API.Binaries) > 1 {
		binaries = opt.API.Binaries
	}
	if len(binaries) > 1 || opt.binaryMigrates {
		for _, b := range binaries {
			cmd := exec.CommandContext(ctx, b, "migrate")
			cmd.Env = append(os.Environ(), "DATABASE_URL="+e.dsn)
			if out, err := cmd.CombinedOutput(); err != nil {
				return nil, fmt.Errorf("bench: %s migrate: %w\n%s", b, err, out)
			}
		}
	}
	db := stdlib.OpenDBFromPool(e.admin)
	_, err = migrations.Up(ctx, db)
	if err == nil {
		_, err = migrations.UpExample(ctx, db)
	}
	db.Close()
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}

	if e.redisDB, err = localserver.LeaseRedisDB(ctx, opt.RedisURL, true); err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	if e.rdb, err = openRedis(ctx, e.redisDB.URL); err != nil {
		return nil, err
	}

	if e.fpPool, err = e.openPool(ctx, 16); err != nil {
		return nil, err
	}
	e.fakepay = httptest.NewServer(fakepay.New(e.fpPool, fakepay.Config{HonorKeys: true}))
	e.charger = handlers.NewCharger(e.fakepay.URL, nil)
	e.probe = newCPUProbe(ctx, e.rdb, e.admin, e.appName)
	return e, nil
}

func (e *env) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if e.fakepay != nil {
		e.fakepay.Close()
	}
	if e.fpPool != nil {
		e.fpPool.Close()
	}
	if e.rdb != nil {
		e.rdb.Close()
	}
	if e.redisDB != nil {
		e.redisDB.Release(false)
	}
	if e.admin != nil {
		e.admin.Close()
	}
	if e.schema != nil {
		e.schema.Drop(ctx)
	}
}

func (e *env) openPool(ctx context.Context, maxConns int32) (*pgxpool.Pool, error) {
	pool, err := dial.Postgres(ctx, e.dsn, maxConns)
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	return pool, nil
}

func openRedis(ctx context.Context, u string) (*redis.Client, error) {
	c, err := dial.RedisNode(ctx, u)
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	return c, nil
}

// stack is what one worker (one asynq server) has of its own, as an `idemq worker`
// process would: a Redis client, a Postgres pool, a ledger, a locker.
type stack struct {
	rdb    *redis.Client
	pool   *pgxpool.Pool
	ledger *idempotency.Ledger
	locker *lock.Locker
	worker *asynqmw.Worker
	// keyWorker is worker with asynqmw.Config.LockKeyScoped (ConfigFullLock).
	keyWorker *asynqmw.Worker
	// commits and rows count the ledger's shared commits and the requests they carried.
	commits, rows atomic.Int64
}

// poolSize is each server's Postgres pool: the worker's (server.PoolSize), within a
// budget of Options.PoolBudget connections shared by the servers (the shared Postgres
// allows 100 clients in all).
func (e *env) poolSize(servers int) int32 {
	return max(4, min(server.PoolSize(e.opt.Concurrency, runtime.GOMAXPROCS(0)), int32(e.opt.PoolBudget/servers)))
}

func (e *env) newStack(ctx context.Context, servers int) (*stack, error) {
	return openStack(ctx, e.redisDB.URL, e.dsn, e.poolSize(servers))
}

// openStack opens one worker's Redis client and Postgres pool (every connection opened
// now, so that a measurement does not pay for it) and builds its ledger, locker and
// worker.
func openStack(ctx context.Context, redisURL, dsn string, poolSize int32) (*stack, error) {
	st := &stack{}
	var err error
	if st.rdb, err = openRedis(ctx, redisURL); err != nil {
		return nil, err
	}
	if st.pool, err = dial.Postgres(ctx, dsn, poolSize); err != nil {
		st.rdb.Close()
		return nil, fmt.Errorf("bench: %w", err)
	}
	conns := make([]*pgxpool.Conn, 0, st.pool.Config().MaxConns)
	for range st.pool.Config().MaxConns {
		c, err := st.pool.Acquire(ctx)
		if err != nil {
			break
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
	st.ledger = idempotency.New(st.pool, &idempotency.Config{ObserveBatch: func(_ string, n int) {
		st.commits.Add(1)
		st.rows.Add(int64(n))
	}})
	st.locker = lock.New(st.rdb, nil)
	// As `idemq worker` does: results reach asynq through the compare-and-set script.
	st.worker = asynqmw.NewWorker(st.ledger, st.locker, &asynqmw.Config{LockTTL: lockTTL, Redis: st.rdb})
	st.keyWorker = asynqmw.NewWorker(st.ledger, st.locker, &asynqmw.Config{LockTTL: lockTTL, Redis: st.rdb, LockKeyScoped: true})
	return st, nil
}

func (st *stack) close() {
	st.worker.Wait()
	st.keyWorker.Wait()
	st.ledger.Close()
	st.pool.Close()
	st.rdb.Close()
}

// reset empties the Redis database and the tables the workloads write, so every
// measurement starts from the same state.
func (e *env) reset(ctx context.Context) error {
	if err := e.resetKeepingLedger(ctx); err != nil {
		return err
	}
	if _, err := e.admin.Exec(ctx, `TRUNCATE processed_jobs, processed_job_steps`); err != nil {
		return fmt.Errorf("bench: truncate: %w", err)
	}
	return nil
}

// resetKeepingLedger is reset without emptying the ledger (processed_jobs and its step
// records, processed_job_steps).
func (e *env) resetKeepingLedger(ctx context.Context) error {
	if err := e.rdb.FlushDB(ctx).Err(); err != nil {
		return fmt.Errorf("bench: empty the leased Redis database: %w", err)
	}
	if _, err := e.admin.Exec(ctx, `TRUNCATE wallet_entries, fakepay_charges, fakepay_requests, fakepay_emails, orders, job_intents`); err != nil {
		return fmt.Errorf("bench: truncate: %w", err)
	}
	return nil
}

// enqueue publishes n tasks of w with keys starting with prefix, from 16 goroutines.
func (e *env) enqueue(ctx context.Context, w *workload, prefix string, n int) error {
	return e.enqueueRange(ctx, w, prefix, 0, n)
}

// enqueuePaced publishes n tasks of w, one every 1/rate seconds.
func (e *env) enqueuePaced(ctx context.Context, w *workload, prefix string, n int, rate float64) error {
	tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer tick.Stop()
	for i := range n {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
		if err := e.enqueueRange(ctx, w, prefix, i, i+1); err != nil {
			return err
		}
	}
	return nil
}

// enqueueRange publishes tasks from to to-1 of w with keys starting with prefix, from 16
// goroutines.
func (e *env) enqueueRange(ctx context.Context, w *workload, prefix string, from, to int) error {
	client := asynq.NewClientFromRedisClient(e.rdb)
	now := time.Now()
	return inParallel(ctx, from, to, func(i int) error {
		s := w.spec(prefix, i)
		id := s.Key
		if w.taskID != nil {
			id = w.taskID(s, i)
		}
		if _, err := client.EnqueueContext(ctx, s.Task(id, now)); err != nil {
			return fmt.Errorf("bench: enqueue %s: %w", s.Key, err)
		}
		return nil
	})
}

// inParallel runs f for every i in from..to-1 from 16 goroutines, until the first error
// (which it returns) or ctx's end.
func inParallel(ctx context.Context, from, to int, f func(i int) error) error {
	var next atomic.Int64
	next.Store(int64(from))
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= to || ctx.Err() != nil {
					return
				}
				if err := f(i); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	if firstErr == nil {
		firstErr = ctx.Err()
	}
	return firstErr
}

// recorder wraps a configuration's handler: it times each delivery and the business
// function inside it.
type recorder struct {
	n        int
	first    atomic.Int64 // unix ns of the first delivery's start
	last     atomic.Int64 // unix ns of the last successful delivery's end
	slot     atomic.Int64 // next overhead slot
	done     atomic.Int64 // successful deliveries
	errs     atomic.Int64 // failed deliveries (asynqmw.IsFailure)
	busy     atomic.Int64 // busy answers (a duplicate of a key in flight): retried, not failures
	lastErr  atomic.Value
	overhead []time.Duration
	finished chan struct{}
	once     sync.Once
}

func newRecorder(n int) *recorder {
	return &recorder{n: n, overhead: make([]time.Duration, n), finished: make(chan struct{})}
}

func (r *recorder) wrap(h asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		start := time.Now()
		r.first.CompareAndSwap(0, start.UnixNano())
		var inner time.Duration
		err := h.ProcessTask(context.WithValue(ctx, innerKey{}, &inner), t)
		end := time.Now()
		if err != nil && !asynqmw.IsFailure(err) {
			r.busy.Add(1)
			return err
		}
		if err != nil {
			r.errs.Add(1)
			r.lastErr.Store(err.Error())
			return err
		}
		// Record first, count last: whoever counts the n-th task sees every record.
		if slot := int(r.slot.Add(1)); slot <= r.n {
			r.overhead[slot-1] = end.Sub(start) - inner
		}
		for {
			l := r.last.Load()
			if end.UnixNano() <= l || r.last.CompareAndSwap(l, end.UnixNano()) {
				break
			}
		}
		if int(r.done.Add(1)) >= r.n {
			r.once.Do(func() { close(r.finished) })
		}
		return nil
	})
}

// measure runs one measurement: n tasks of w through config on servers asynq servers.
func (e *env) measure(ctx context.Context, w *workload, config string, servers, n, rep int) (Sample, error) {
	concurrency := e.opt.Concurrency
	if w.concurrency > 0 {
		concurrency = w.concurrency
	}
	s := Sample{Workload: w.name, Config: config, Servers: servers, Rep: rep, N: n, Concurrency: concurrency}
	if err := e.reset(ctx); err != nil {
		return s, err
	}
	prefix := fmt.Sprintf("%s%d-%s", config, e.measured.Add(1), randomHex(2))
	if w.rate <= 0 {
		if err := e.enqueue(ctx, w, prefix, n); err != nil {
			return s, err
		}
	}
	stacks := make([]*stack, 0, servers)
	defer func() {
		for _, st := range stacks {
			st.close()
		}
	}()
	for range servers {
		st, err := e.newStack(ctx, servers)
		if err != nil {
			return s, err
		}
		stacks = append(stacks, st)
	}
	s.PoolPerServer = int(e.poolSize(servers))

	rec := newRecorder(n)
	srvs := make([]*asynq.Server, 0, servers)
	stopAll := func() {
		var wg sync.WaitGroup
		for _, srv := range srvs {
			wg.Add(1)
			go func() { defer wg.Done(); srv.Shutdown() }()
		}
		wg.Wait()
		srvs = nil
	}
	defer stopAll()
	before := e.probe.snap(ctx)
	for _, st := range stacks {
		srv := asynq.NewServerFromRedisClient(st.rdb, serverConfig(concurrency))
		mux := asynq.NewServeMux()
		mux.Handle(w.taskType, rec.wrap(w.handler(config, st)))
		if err := srv.Start(mux); err != nil {
			return s, fmt.Errorf("bench: start asynq server: %w", err)
		}
		srvs = append(srvs, srv)
	}
	paced := make(chan error, 1)
	if w.rate > 0 {
		go func() { paced <- e.enqueuePaced(ctx, w, prefix, n, w.rate) }()
	}
	timeout := 2*time.Minute + time.Duration(10*e.opt.Seconds*float64(time.Second))
	if w.rate > 0 {
		timeout += time.Duration(float64(n) / w.rate * float64(time.Second))
	}
	deadline := time.After(timeout)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
wait:
	for {
		select {
		case <-rec.finished:
			break wait
		case err := <-paced:
			if err != nil {
				return s, err
			}
			continue
		case <-ctx.Done():
			return s, ctx.Err()
		case <-tick.C:
			// Errors are retried (every 100 ms); more errors than tasks means a broken
			// configuration, not a slow one.
			if rec.errs.Load() <= int64(n)+10 {
				continue
			}
		case <-deadline:
		}
		msg, _ := rec.lastErr.Load().(string)
		return s, fmt.Errorf("bench: %s %s: %d of %d tasks done (%d errors; last: %s)", w.name, config, rec.done.Load(), n, rec.errs.Load(), msg)
	}
	after := e.probe.snap(ctx)
	stopAll()
	var commits, rows int64
	for _, st := range stacks {
		commits, rows = commits+st.commits.Load(), rows+st.rows.Load()
	}
	if commits > 0 {
		s.RowsPerCommit = float64(rows) / float64(commits)
	}

	drain := time.Duration(rec.last.Load() - rec.first.Load())
	s.DrainSeconds = drain.Seconds()
	s.TasksPerSecond = float64(n) / drain.Seconds()
	s.Errors, s.Busy = int(rec.errs.Load()), int(rec.busy.Load())
	oh := slices.Clone(rec.overhead)
	slices.Sort(oh)
	s.OverheadP50us = micros(percentile(oh, 0.50))
	s.OverheadP99us = micros(percentile(oh, 0.99))
	d := before.to(after)
	s.CPU = CPU{Go: d.self / float64(n) * 1e6, Redis: d.redis / float64(n) * 1e6, Postgres: d.pg / float64(n) * 1e6}
	s.CPU.Total = s.CPU.Go + s.CPU.Redis + s.CPU.Postgres
	return s, nil
}

// serverConfig is the asynq configuration of every server a measurement starts: the
// worker binary's (server.AsynqConfig).
func serverConfig(concurrency int) asynq.Config {
	cfg := server.AsynqConfig(concurrency, map[string]int{tasks.Queue: 1}, 10*time.Second)
	cfg.LogLevel = asynq.ErrorLevel
	return cfg
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p*float64(len(sorted))+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func micros(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}
