package server

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/idempotency/schedule"
	"github.com/idemq/idemq/lock"
)

// Defaults of Config, the settings `idemq worker` runs with.
const (
	DefaultConcurrency     = 10
	DefaultQueue           = "default"
	DefaultLease           = 30 * time.Second
	DefaultShutdownTimeout = 30 * time.Second
	DefaultRetention       = 30 * 24 * time.Hour
	DefaultTaskRetention   = 24 * time.Hour
	DefaultTaskMaxRetry    = 25
	DefaultReconcileGrace  = 3 * time.Minute
)

// purgeEvery is how often one replica (whichever takes the purge lock) purges expired
// ledger rows, for at most half of it, and marks stuck ones: often enough that each round
// deletes about a minute's inflow of expiring rows, not an hour's in one burst.
const purgeEvery = time.Minute

// purgeLock is the lock scope whose holder takes the purge's turn.
const purgeLock = "idemq:purge"

// Config configures a Server. Postgres and Redis are required; the zero value of every
// other field means its default. The nested configurations (Ledger, Worker, Outbox, Lock)
// reach every setting of the pieces a Server runs; a Server fills their loggers and the
// fields this struct also has when they are left zero, and refuses two different values
// for one setting.
type Config struct {
	// Postgres holds the ledger and the outbox: its connections must see idemq's tables
	// (migrations.Up, in the pool's search_path). Size it with PoolSize. Required; the
	// Server does not close it.
	Postgres *pgxpool.Pool

	// Redis holds asynq's queues and the locks. Required; the Server does not close it.
	Redis redis.UniversalClient

	// SQL is the database/sql pool HandleSQLTx handlers get their transactions from, on
	// the same database as Postgres: pgx's stdlib or lib/pq (a wrapper around one of them
	// is vouched for with Ledger.SQLDriver). Default: one over Postgres
	// (stdlib.OpenDBFromPool), opened at the first SQL delivery. The Server does not
	// close one passed in.
	SQL *sql.DB

	// Concurrency is how many tasks run at once. Default 10.
	Concurrency int

	// Queues are the asynq queues served, with their weights (asynq.Config.Queues).
	// Default {"default": 1}.
	Queues map[string]int

	// Lease is the ledger's lease of a claim (idempotency.Config.Lease); heartbeats
	// extend it every Lease/3. Default 30s.
	Lease time.Duration

	// ShutdownTimeout is how long Run waits for running tasks once its context ends
	// before they are handed back to asynq. Default 30s.
	ShutdownTimeout time.Duration

	// Retention is how long completed and failed ledger rows are kept: one replica a
	// minute purges older ones (for at most 30 s a round), with their outbox intents, and
	// marks rows stuck in progress past idempotency.Config.MaxAge as needing attention.
	// It must be at least MinRetention(TaskRetention, TaskMaxRetry, the busy budget), or
	// New refuses it. Default 720h (30 days).
	Retention time.Duration

	// TaskRetention and TaskMaxRetry are the longest asynq Retention and the largest
	// MaxRetry of the tasks this Server runs; they bound Retention from below (see
	// MinRetention). Defaults 24h and 25 (asynq's default MaxRetry).
	TaskRetention time.Duration
	TaskMaxRetry  int

	// ReconcileGrace is how long an accepted job (an outbox intent) may be missing from
	// Redis before the reconciler republishes it (outbox.Config.Grace); it should exceed
	// asynq's own recovery of a crashed worker's task (60–120 s). A Redis that lost its
	// data (a restart, a flush) is noticed within seconds and reconciled at once,
	// whatever the grace. Default 3m.
	ReconcileGrace time.Duration

	// Logger receives the Server's lines and, unless the nested configurations name
	// their own, the ledger's, the middleware's, the lock's and the outbox's ("component"
	// outbox), and asynq's ("component" asynq, at the level the Logger enables). Default:
	// slog.Default() as New finds it (Info and above, unless you set another default):
	// failed deliveries, lost leases and an unreachable Redis or Postgres are logged. To
	// discard everything, give slog.New(slog.DiscardHandler).
	Logger *slog.Logger

	// Ledger configures the ledger (idempotency.New). Its Observe and ObserveBatch feed
	// metrics. Default: idempotency's defaults with Lease and Logger above.
	Ledger *idempotency.Config

	// Worker configures the middleware (asynqmw.NewWorker). Its Observe fields feed
	// metrics. Defaults as asynqmw's, except ScopeWaiters: max(8, 4/5 of Concurrency),
	// so that a hot scope may keep four fifths of the slots busy while a fifth stays
	// free for other scopes; and Redis: the Redis above, so that a result is written to
	// asynq's hash only while asynq still holds the task.
	Worker *asynqmw.Config

	// Outbox configures the outbox client (outbox.NewClient), its relay and its
	// reconciler. Its Observe feeds metrics. Default: outbox's defaults with
	// ReconcileGrace and Logger above.
	Outbox *outbox.Config

	// Lock configures the Redis locker (lock.New). Default: lock's defaults with Logger
	// above.
	Lock *lock.Config

	// ObserveRecovered, if set, is called with the task type of each task asynq
	// recovers after its lease expired: the worker running it died or lost Redis for
	// longer than asynq's 30 s lease. asynq's recoverer retries such a task with
	// asynq.ErrLeaseExpired, which IsFailure counts as a failure (it shows as one in
	// asynqmon, though the ledger keeps its effect single): a task that keeps killing its
	// worker must still run out of retries. It is called where asynq asks for the retry
	// delay, the one hook of that path that carries the task, right before IsFailure (a
	// RetryDelayFunc set by Asynq below replaces it, and this count with it). A task
	// whose retries were already spent is archived without either call and is not
	// counted.
	ObserveRecovered func(taskType string)

	// ObserveOverBudget, if set, is called with the task type and the reason ("busy" or
	// "unavailable") of each delivery that found its key busy, or Postgres out of reach,
	// past the busy budget (asynqmw.BusyTooLongError, asynqmw.UnavailableTooLongError):
	// that delivery counts as a failure.
	ObserveOverBudget func(taskType, reason string)

	// Asynq, if set, is called last with the asynq server's configuration (AsynqConfig
	// plus the Server's logger and error handler), to change any asynq setting: what it
	// sets wins.
	Asynq func(*asynq.Config)

	// Schedule, when not nil, makes Run also run a scheduler replica (package schedule)
	// with these periodic entries: upserted into schedule_entries at start, each tick one
	// job through the outbox. Register the entries' task types like any other. An empty,
	// non-nil slice empties the schedule. New checks the entries (errors name the entry
	// and the field) and their catch-up windows against Retention.
	Schedule []schedule.Entry
	// Scheduler configures the scheduler replica (schedule.New); its Retention is the
	// Server's and its Logger defaults to Logger above.
	Scheduler *schedule.Config
}

// Server runs asynq deliveries through the Redis lock and the ledger, and the outbox's
// relay and reconciler and the ledger's retention beside them: everything `idemq worker`
// runs but its metrics listener. Register handlers (HandleTx, HandleLeased, Handle), then
// call Run. Its methods are safe for concurrent use.
type Server struct {
	cfg    Config // with defaults
	log    *slog.Logger
	acfg   asynq.Config
	ledger *idempotency.Ledger
	locker *lock.Locker
	worker *asynqmw.Worker
	outbox *outbox.Client
	lockTTL,
	busyBudget time.Duration

	sched *schedule.Scheduler // nil without Config.Schedule

	mu      sync.Mutex
	mux     *asynq.ServeMux
	types   []string // registered task types, in order
	started bool
	// sqlHandlers: a HandleSQLTx handler is registered, so Run checks Config.SQL.
	sqlHandlers bool
}

// New checks cfg, fills its defaults and returns a Server with its ledger, locker,
// middleware and outbox client made. Nothing runs until Run. An invalid setting is an
// error naming the field.
func New(cfg Config) (*Server, error) {
	if err := withDefaults(&cfg); err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, log: cfg.Logger, mux: asynq.NewServeMux()}

	lcfg := idempotency.Config{}
	if cfg.Ledger != nil {
		lcfg = *cfg.Ledger
	}
	lcfg.Lease = cfg.Lease
	if cfg.SQL != nil {
		lcfg.SQL = cfg.SQL
	}
	if lcfg.Logger == nil {
		lcfg.Logger = s.log
	}

	wcfg := asynqmw.Config{}
	if cfg.Worker != nil {
		wcfg = *cfg.Worker
	}
	if wcfg.LockTTL <= 0 {
		wcfg.LockTTL = 30 * time.Second
	}
	if wcfg.BusyBudget <= 0 {
		wcfg.BusyBudget = max(2*cfg.Lease, 15*time.Minute)
	}
	if wcfg.ScopeWaiters <= 0 {
		wcfg.ScopeWaiters = max(8, cfg.Concurrency*4/5)
	}
	if wcfg.Redis == nil {
		wcfg.Redis = cfg.Redis
	}
	if wcfg.Logger == nil {
		wcfg.Logger = s.log
	}
	s.lockTTL, s.busyBudget = wcfg.LockTTL, wcfg.BusyBudget
	if min := MinRetention(cfg.TaskRetention, cfg.TaskMaxRetry, s.busyBudget); cfg.Retention < min {
		return nil, fmt.Errorf("server: Config.Retention %s is shorter than TaskRetention plus the retry horizon of TaskMaxRetry retries plus the busy budget (%s): a retried task could run again after its key was purged",
			cfg.Retention, min.Round(time.Hour))
	}

	ocfg := outbox.Config{}
	if cfg.Outbox != nil {
		ocfg = *cfg.Outbox
	}
	ocfg.Grace = cfg.ReconcileGrace
	if ocfg.Logger == nil {
		ocfg.Logger = s.log.With("component", "outbox")
	}

	kcfg := lock.Config{}
	if cfg.Lock != nil {
		kcfg = *cfg.Lock
	}
	if kcfg.Logger == nil {
		kcfg.Logger = s.log
	}

	s.ledger = idempotency.New(cfg.Postgres, &lcfg)
	s.locker = lock.New(cfg.Redis, &kcfg)
	s.worker = asynqmw.NewWorker(s.ledger, s.locker, &wcfg)
	s.outbox = outbox.NewClient(cfg.Postgres, cfg.Redis, &ocfg)

	if cfg.Schedule != nil {
		scfg := schedule.Config{}
		if cfg.Scheduler != nil {
			scfg = *cfg.Scheduler
		}
		scfg.Retention = cfg.Retention
		if scfg.Logger == nil {
			scfg.Logger = s.log.With("component", "schedule")
		}
		sched, err := schedule.New(cfg.Postgres, s.outbox, cfg.Schedule, &scfg)
		if err != nil {
			s.ledger.Close()
			return nil, fmt.Errorf("server: Config.Schedule: %w", err)
		}
		s.sched = sched
	}

	s.acfg = AsynqConfig(cfg.Concurrency, cfg.Queues, cfg.ShutdownTimeout)
	s.acfg.Logger = asynqLogger{s.log.With("component", "asynq")}
	s.acfg.LogLevel = asynqLevel(s.log)
	s.acfg.ErrorHandler = asynq.ErrorHandlerFunc(s.logError)
	if observe := cfg.ObserveRecovered; observe != nil {
		delay := s.acfg.RetryDelayFunc
		s.acfg.RetryDelayFunc = func(n int, err error, t *asynq.Task) time.Duration {
			if errors.Is(err, asynq.ErrLeaseExpired) {
				observe(t.Type())
			}
			return delay(n, err, t)
		}
	}
	if cfg.Asynq != nil {
		cfg.Asynq(&s.acfg)
	}
	return s, nil
}

// withDefaults checks cfg and fills its zero fields.
func withDefaults(cfg *Config) error {
	if cfg.Postgres == nil {
		return errors.New("server: Config.Postgres is required")
	}
	if cfg.Redis == nil {
		return errors.New("server: Config.Redis is required")
	}
	for name, v := range map[string]int{"Concurrency": cfg.Concurrency, "TaskMaxRetry": cfg.TaskMaxRetry} {
		if v < 0 {
			return fmt.Errorf("server: Config.%s is %d: must not be negative (0 means the default)", name, v)
		}
	}
	for name, d := range map[string]time.Duration{
		"Lease": cfg.Lease, "ShutdownTimeout": cfg.ShutdownTimeout, "Retention": cfg.Retention,
		"TaskRetention": cfg.TaskRetention, "ReconcileGrace": cfg.ReconcileGrace,
	} {
		if d < 0 {
			return fmt.Errorf("server: Config.%s is %s: must not be negative (0 means the default)", name, d)
		}
	}
	for name, w := range cfg.Queues {
		if name == "" {
			return errors.New("server: Config.Queues: a queue name is empty")
		}
		if w <= 0 {
			return fmt.Errorf("server: Config.Queues[%q] is %d: a weight must be at least 1", name, w)
		}
	}
	if cfg.Ledger != nil && cfg.Ledger.Lease != 0 {
		if cfg.Lease != 0 && cfg.Lease != cfg.Ledger.Lease {
			return fmt.Errorf("server: Config.Lease (%s) and Config.Ledger.Lease (%s) differ: set one", cfg.Lease, cfg.Ledger.Lease)
		}
		cfg.Lease = cfg.Ledger.Lease
	}
	if cfg.Outbox != nil && cfg.Outbox.Grace != 0 {
		if cfg.ReconcileGrace != 0 && cfg.ReconcileGrace != cfg.Outbox.Grace {
			return fmt.Errorf("server: Config.ReconcileGrace (%s) and Config.Outbox.Grace (%s) differ: set one", cfg.ReconcileGrace, cfg.Outbox.Grace)
		}
		cfg.ReconcileGrace = cfg.Outbox.Grace
	}
	orDefault(&cfg.Concurrency, DefaultConcurrency)
	orDefault(&cfg.TaskMaxRetry, DefaultTaskMaxRetry)
	orDefault(&cfg.Lease, DefaultLease)
	orDefault(&cfg.ShutdownTimeout, DefaultShutdownTimeout)
	orDefault(&cfg.Retention, DefaultRetention)
	orDefault(&cfg.TaskRetention, DefaultTaskRetention)
	orDefault(&cfg.ReconcileGrace, DefaultReconcileGrace)
	if len(cfg.Queues) == 0 {
		cfg.Queues = map[string]int{DefaultQueue: 1}
	} else {
		cfg.Queues = maps.Clone(cfg.Queues)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return nil
}

func orDefault[T int | time.Duration](v *T, def T) {
	if *v == 0 {
		*v = def
	}
}

// Ledger returns the Server's ledger, for reads and for what a handler hands on (its
// SelfFenceMargin). Run closes it when it returns.
func (s *Server) Ledger() *idempotency.Ledger { return s.ledger }

// Outbox returns the Server's outbox client, so that the process that runs the jobs can
// also accept them (Enqueue, EnqueueTx). It stays usable after Run returns, as long as
// Postgres and Redis are open.
func (s *Server) Outbox() *outbox.Client { return s.outbox }

// Run starts the asynq server with the registered handlers (a task of any other type is
// archived at once, with a reason naming the known ones), the outbox relay and
// reconciler, and the ledger's retention (one replica a minute, by a Redis lock, purges
// rows older than Config.Retention for at most 30 s and marks stuck ones). When ctx ends
// it drains: deliveries waiting for a scope's lock answer busy (another replica runs
// them), running ones get Config.ShutdownTimeout, their locks go back to Redis, the
// background loops stop; then it closes the ledger and returns nil. It returns an error
// when asynq cannot start, when no handler is registered, or when called a second time.
func (s *Server) Run(ctx context.Context) error {
	s.mu.Lock()
	if s.started {
		s.mu.Unlock()
		return errors.New("server: Run called twice")
	}
	s.started = true
	types := slices.Clone(s.types)
	s.mu.Unlock()
	defer s.ledger.Close()
	if len(types) == 0 {
		return errors.New("server: no handlers: register task types with HandleTx, HandleSQLTx, HandleLeased or Handle before Run")
	}
	if s.sqlHandlers {
		if err := s.ledger.CheckSQL(); err != nil {
			return fmt.Errorf("server: HandleSQLTx: %w", err)
		}
	}

	srv := asynq.NewServerFromRedisClient(s.cfg.Redis, s.acfg)
	if err := srv.Start(asynqmw.ArchiveUnknown(s.mux, types...)); err != nil {
		return fmt.Errorf("start asynq server: %w", err)
	}
	s.log.Info("worker started", "concurrency", s.acfg.Concurrency, "queues", queueList(s.acfg.Queues),
		"lease", s.cfg.Lease, "lock_ttl", s.lockTTL)

	var wg sync.WaitGroup
	// One replica a minute purges: whichever takes the purge lock, left to expire.
	wg.Go(func() {
		s.ledger.RunRetention(ctx, idempotency.RetentionConfig{OlderThan: s.cfg.Retention, Every: purgeEvery, Logger: s.log,
			Turn: func(ctx context.Context) bool {
				_, err := s.locker.Obtain(ctx, purgeLock, purgeEvery, nil)
				return err == nil
			}})
	})
	// Every replica runs the outbox relay and reconciler: they take disjoint batches.
	wg.Go(func() { s.outbox.RunRelay(ctx) })
	wg.Go(func() { s.outbox.RunReconciler(ctx) })
	if s.sched != nil {
		wg.Go(func() {
			if err := s.sched.Run(ctx); err != nil {
				s.log.Error("scheduler stopped: its entries are not scheduled by this replica", "err", err)
			}
		})
	}

	<-ctx.Done()
	s.log.Info("draining", "shutdown_timeout", s.acfg.ShutdownTimeout)
	s.worker.Stop() // deliveries waiting for a scope's lock answer busy: another replica runs them
	srv.Shutdown()
	s.worker.Wait() // the last deliveries' locks go back to Redis before the caller closes it
	wg.Wait()
	s.log.Info("worker stopped")
	return nil
}

// logError logs a delivery's error at the level it deserves: a failure warns, a
// Postgres out of reach warns, busy is routine.
func (s *Server) logError(ctx context.Context, t *asynq.Task, err error) {
	if observe := s.cfg.ObserveOverBudget; observe != nil {
		var busy *asynqmw.BusyTooLongError
		var unavailable *asynqmw.UnavailableTooLongError
		switch {
		case errors.As(err, &busy):
			observe(t.Type(), "busy")
		case errors.As(err, &unavailable):
			observe(t.Type(), "unavailable")
		}
	}
	switch {
	case asynqmw.IsFailure(err):
		s.log.Warn("task failed", "task_type", t.Type(), "err", err)
	case idempotency.IsUnavailable(err):
		s.log.Warn("Postgres unavailable; retrying the task soon", "task_type", t.Type(), "err", err)
	default:
		s.log.Debug("task busy; retrying soon", "task_type", t.Type(), "err", err)
	}
}

// asynqLevel is the asynq log level matching the lowest level l enables.
func asynqLevel(l *slog.Logger) asynq.LogLevel {
	ctx := context.Background()
	switch {
	case l.Enabled(ctx, slog.LevelDebug):
		return asynq.DebugLevel
	case l.Enabled(ctx, slog.LevelInfo):
		return asynq.InfoLevel
	case l.Enabled(ctx, slog.LevelWarn):
		return asynq.WarnLevel
	case l.Enabled(ctx, slog.LevelError):
		return asynq.ErrorLevel
	}
	return asynq.FatalLevel
}

// queueList writes queues as IDEMQ_QUEUES does, sorted: "name", or "name:weight" for a
// weight other than 1.
func queueList(queues map[string]int) []string {
	list := make([]string, 0, len(queues))
	for _, name := range slices.Sorted(maps.Keys(queues)) {
		if w := queues[name]; w != 1 {
			name += ":" + strconv.Itoa(w)
		}
		list = append(list, name)
	}
	return list
}
