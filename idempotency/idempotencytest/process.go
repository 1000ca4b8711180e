package idempotencytest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/idempotency/internal/testhook"
	"github.com/idemq/idemq/idempotency/server"
	"github.com/idemq/idemq/lock"
)

// errDead is what a crashed process's connections answer.
var errDead = errors.New("idempotencytest: the worker process is dead")

// gate is a simulated process's state as its connections see it: alive, paused (a
// frozen process sends nothing) or dead.
type gate struct {
	mu     sync.Mutex
	dead   bool
	paused chan struct{} // closed on resume; nil when running
}

// wait returns when the process may use a connection, or errDead.
func (g *gate) wait(ctx context.Context) error {
	for {
		g.mu.Lock()
		dead, paused := g.dead, g.paused
		g.mu.Unlock()
		switch {
		case dead:
			return errDead
		case paused == nil:
			return nil
		}
		select {
		case <-paused:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

func (g *gate) pause() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.paused == nil {
		g.paused = make(chan struct{})
	}
}

func (g *gate) resume() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.paused != nil {
		close(g.paused)
		g.paused = nil
	}
}

func (g *gate) kill() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.dead = true
	if g.paused != nil {
		close(g.paused)
		g.paused = nil
	}
}

// redisGate holds a process's Redis commands while it is paused and fails them once it
// is dead.
type redisGate struct{ g *gate }

func (h redisGate) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		if err := h.g.wait(ctx); err != nil {
			return nil, err
		}
		return next(ctx, network, addr)
	}
}

func (h redisGate) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if err := h.g.wait(ctx); err != nil {
			cmd.SetErr(err)
			return err
		}
		return next(ctx, cmd)
	}
}

func (h redisGate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if err := h.g.wait(ctx); err != nil {
			return err
		}
		return next(ctx, cmds)
	}
}

// process is one simulated worker process: its own Postgres pools, Redis clients,
// ledger, lock, worker and asynq server, on the schedule's queue.
type process struct {
	r    *run
	name string
	app  string // its sessions' application_name
	gate gate

	pool   *pgxpool.Pool
	sql    *sql.DB // Config.SQL's, if set
	ledger *idempotency.Ledger
	worker *asynqmw.Worker
	locks  *redis.Client // the lock and the result writes; dies with the process
	queue  *redis.Client // asynq's; it hands the task back when the process dies
	srv    *asynq.Server

	stopOnce sync.Once
	down     chan struct{} // closed when asynq let go of its tasks
}

// startProcess starts a worker process serving the run's queue.
func (r *run) startProcess(concurrency int) (*process, error) {
	r.mu.Lock()
	r.nproc++
	p := &process{r: r, name: fmt.Sprintf("w%d", r.nproc), down: make(chan struct{})}
	r.procs = append(r.procs, p)
	r.mu.Unlock()
	p.app = "idemqtest-" + r.id + "-" + p.name

	pc := r.cfg.Pool.Config()
	pc.MaxConns, pc.MinConns = int32(concurrency+2), 0
	pc.ConnConfig.RuntimeParams["application_name"] = p.app
	userConnect, userPrepare := pc.BeforeConnect, pc.PrepareConn
	pc.BeforeConnect = func(ctx context.Context, cc *pgx.ConnConfig) error {
		if err := p.gate.wait(ctx); err != nil {
			return err
		}
		if userConnect != nil {
			return userConnect(ctx, cc)
		}
		return nil
	}
	pc.PrepareConn = func(ctx context.Context, c *pgx.Conn) (bool, error) {
		if err := p.gate.wait(ctx); err != nil {
			return false, err
		}
		if userPrepare != nil {
			return userPrepare(ctx, c)
		}
		return true, nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	if err != nil {
		return nil, err
	}
	p.pool = pool
	if r.cfg.SQL != nil {
		if p.sql, err = r.cfg.SQL(p.app); err != nil {
			pool.Close()
			return nil, fmt.Errorf("idempotencytest: Config.SQL: %w", err)
		}
	}
	lease := r.cfg.Lease
	p.ledger = idempotency.New(pool, &idempotency.Config{
		SQL:   p.sql,
		Lease: lease, SessionTimeout: lease, ClaimLockTimeout: lease / 4, WriteTimeout: 5 * time.Second,
		Logger: r.cfg.Logger.With("process", p.name),
		ObserveBatch: func(_ string, n int) {
			r.mu.Lock()
			r.maxBatch = max(r.maxBatch, n)
			r.mu.Unlock()
		},
	})
	p.locks = r.newRedis()
	p.locks.AddHook(redisGate{&p.gate})
	p.queue = r.newRedis()
	w := asynqmw.NewWorker(p.ledger, lock.New(p.locks, &lock.Config{Prefix: r.lockPrefix}), &asynqmw.Config{
		LockTTL: lease, Redis: p.locks, Logger: r.cfg.Logger.With("process", p.name),
	})
	p.worker = w
	mux := asynq.NewServeMux()
	if r.cfg.Handlers != nil {
		r.cfg.Handlers(server.Mux(w, mux))
	}
	if r.cfg.Register != nil {
		r.cfg.Register(w, mux)
	}
	registerFillers(w, mux)
	acfg := asynq.Config{
		Concurrency: concurrency, Queues: map[string]int{r.queue: 1},
		TaskCheckInterval: 20 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond,
		ShutdownTimeout: 200 * time.Millisecond, Logger: quietLogger{}, LogLevel: asynq.FatalLevel,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 100 * time.Millisecond },
	}
	asynqmw.Configure(&acfg)
	p.srv = asynq.NewServerFromRedisClient(p.queue, acfg)
	if err := p.srv.Start(asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		return r.deliver(ctx, p, mux, t)
	})); err != nil {
		return nil, err
	}
	return p, nil
}

// newRedis opens a client to the test's Redis, with its connection settings.
func (r *run) newRedis() *redis.Client {
	o := r.cfg.Redis.Options()
	return redis.NewClient(&redis.Options{
		Network: o.Network, Addr: o.Addr, Dialer: o.Dialer, Protocol: o.Protocol,
		Username: o.Username, Password: o.Password, CredentialsProvider: o.CredentialsProvider,
		DB: o.DB, TLSConfig: o.TLSConfig, DialTimeout: o.DialTimeout,
	})
}

// stopAsynq stops the process's asynq server: it pulls no more tasks and, past its
// shutdown timeout, hands back the tasks its handlers still hold.
func (p *process) stopAsynq() {
	p.stopOnce.Do(func() {
		go func() {
			p.srv.Shutdown()
			close(p.down)
		}()
	})
}

// close ends a process that is still alive, at the end of the schedule.
func (p *process) close() {
	p.gate.resume()
	p.stopAsynq()
	<-p.down
	p.gate.mu.Lock()
	dead := p.gate.dead
	p.gate.mu.Unlock()
	if dead {
		return // its parked delivery holds what it held: leave it
	}
	p.worker.Wait()
	p.ledger.Close()
	if p.sql != nil {
		p.sql.Close()
	}
	p.pool.Close()
	p.locks.Close()
	p.queue.Close()
}

// crash kills the process as kill -9 would, from inside one of its deliveries, and never
// returns: the delivery's goroutine stays parked, so none of its deferred functions (the
// lock's release, the heartbeat's end) and no completion runs. Its Postgres sessions are
// terminated by the server (a transaction open in one is rolled back by the server, not
// by a ROLLBACK the process sends), its connections refuse all further use (the
// heartbeats stop reaching the database), its lock client dies (the watchdog stops, the
// lock expires by its TTL), and asynq hands its task back, as its recoverer does for a
// task whose process died.
func (p *process) crash() {
	p.gate.kill()
	p.terminateSessions()
	p.stopAsynq()
	p.r.signal(p, "crashed")
	select {}
}

// terminateSessions has the server end every session of the process and waits until
// they are gone.
func (p *process) terminateSessions() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		var left int
		err := p.r.cfg.Pool.QueryRow(ctx, `
			WITH t AS (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1)
			SELECT count(*) FROM t`, p.app).Scan(&left)
		if err == nil && left == 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// freeze stops the process inside one of its deliveries, as SIGSTOP or a long pause
// does: it pulls no more tasks, and its Postgres and Redis use waits (no heartbeat, no
// lock refresh) until resume; then the delivery goes on.
func (p *process) freeze() {
	p.gate.pause()
	p.srv.Stop()
	p.r.signal(p, "frozen")
	p.gate.wait(context.Background())
}

// quietLogger drops asynq's own log lines (a simulated crash makes it warn).
type quietLogger struct{}

func (quietLogger) Debug(...any) {}
func (quietLogger) Info(...any)  {}
func (quietLogger) Warn(...any)  {}
func (quietLogger) Error(...any) {}
func (quietLogger) Fatal(...any) {}

var _ testhook.Hook = (*hook)(nil)
