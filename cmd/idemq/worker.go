package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/handlers"
	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/config"
	"github.com/idemq/idemq/internal/dial"
	"github.com/idemq/idemq/internal/httpserver"
	"github.com/idemq/idemq/internal/metrics"
	"github.com/idemq/idemq/internal/tracing"
	"github.com/idemq/idemq/internal/unguarded"
	"github.com/idemq/idemq/internal/workerconf"
	"github.com/idemq/idemq/lock"
	"github.com/idemq/idemq/tasks"
)

func workerCommand() command {
	return command{
		name:    "worker",
		usage:   "worker",
		summary: "run one worker replica: asynq deliveries through the Redis lock and the ledger (SIGTERM drains)",
		spec:    func() any { return &config.Worker{} },
		traced:  "idemq-worker",
		run: func(ctx context.Context, spec any, args []string, _, stderr io.Writer) error {
			if len(args) > 0 {
				return fmt.Errorf("worker: unexpected arguments %q", args)
			}
			return runWorker(ctx, spec.(*config.Worker), newLogger(stderr, spec.(*config.Worker).LogLevel).With("cmd", "worker"))
		},
	}
}

// purgeInterval is how often one replica (whichever takes the purge lock) purges expired
// ledger rows and marks stuck ones.
const purgeInterval = time.Hour

func runWorker(ctx context.Context, cfg *config.Worker, log *slog.Logger) error {
	queues, err := config.QueueWeights(cfg.Queues)
	if err != nil {
		return fmt.Errorf("IDEMQ_QUEUES: %w", err)
	}
	busyBudget := max(2*cfg.Lease, 15*time.Minute)
	if min := minRetention(busyBudget); cfg.Retention < min {
		return fmt.Errorf("IDEMQ_RETENTION=%s is shorter than asynq's task retention plus the longest retry horizon (%s): a retried task could run again after its key was purged", cfg.Retention, min.Round(time.Hour))
	}

	// The metrics address is taken before anything else: a second worker on one host
	// given the same one stops here, before it takes a task.
	var metricsLn net.Listener
	if cfg.MetricsAddr != "" {
		metricsLn, err = net.Listen("tcp", cfg.MetricsAddr)
		if err != nil {
			return fmt.Errorf("IDEMQ_METRICS_ADDR=%s: %w: each worker on one host needs an address of its own "+
				"(IDEMQ_METRICS_ADDR=:9092, :9093, …), or set it empty to serve no metrics", cfg.MetricsAddr, err)
		}
		defer metricsLn.Close()
	}

	stopTracing, err := startTracing(ctx, "idemq-worker", log)
	if err != nil {
		return err
	}
	defer stopTracing()
	rdb, err := dial.Redis(ctx, cfg.RedisURL, cfg.RedisCluster)
	if err != nil {
		return err
	}
	defer rdb.Close()
	db, err := dial.OpenDatabase(ctx, cfg.DatabaseURL, cfg.DirectDatabaseURL, workerconf.PoolSize(cfg.Concurrency, runtime.GOMAXPROCS(0)), log)
	if err != nil {
		return err
	}
	defer db.Close()
	pool := db.Pool
	if err := requireSchema(ctx, pool); err != nil {
		return err
	}

	m := metrics.New()
	if cfg.UnsafeNoFencing {
		log.Warn("IDEMQ_UNSAFE_NO_FENCING is set: stale owners can complete and extend leases they lost (tests only)")
	}
	ledger := idempotency.New(pool, &idempotency.Config{
		Lease:           cfg.Lease,
		MaxAge:          cfg.MaxAge,
		HeartbeatPool:   db.Heartbeats,
		UnsafeNoFencing: cfg.UnsafeNoFencing,
		Logger:          log,
		Observe: func(ev idempotency.Event, taskType string) {
			m.ObserveLedger(string(ev), taskType)
		},
		ObserveBatch: m.ObserveBatch,
	})
	defer ledger.Close()
	locker := lock.New(rdb, &lock.Config{Logger: log})
	w := asynqmw.NewWorker(ledger, locker, &asynqmw.Config{
		LockTTL:    cfg.LockTTL,
		BusyBudget: busyBudget,
		// Four fifths of the slots may wait for one scope (at least the default 8): the
		// hottest account of a Zipf(1.1) skew over 1,000 takes a fifth of the tasks, in
		// bursts, and a delivery turned away bounces through the retry set for a second
		// or more; a fifth stays free for the other scopes.
		ScopeWaiters: max(8, cfg.Concurrency*4/5),
		Redis:        rdb,
		Logger:       log,
		ObserveLock: func(ev asynqmw.LockEvent, taskType string) {
			m.ObserveLock(string(ev), taskType)
		},
		ObserveHandler: m.ObserveHandler,
		ObserveIntentDead: func(taskType, reason string) {
			m.IntentsDead.WithLabelValues(reason, taskType).Inc()
		},
	})

	charger := handlers.NewCharger(cfg.FakepayURL, tracing.Client(handlers.DefaultClient())).WithFenceMargin(ledger.SelfFenceMargin())
	mux := asynq.NewServeMux()
	charge := func(ctx context.Context, c tasks.Charge) (json.RawMessage, error) {
		return charger.Charge(ctx, c.Key(), c)
	}
	fp, err := parseFaultPoints(cfg.UnsafeFaults)
	if err != nil {
		return fmt.Errorf("IDEMQ_UNSAFE_FAULTS: %w", err)
	}
	charge, debit := fp.wrap(charge, handlers.Debit, log)
	if cfg.UnsafeNoGuards {
		log.Warn("IDEMQ_UNSAFE_NO_GUARDS is set: no lock, no ledger; duplicate deliveries take effect twice")
		mux.Handle(tasks.TypeCharge, unguarded.Leased(tasks.TypeCharge, tasks.DecodeCharge, charge))
		mux.Handle(tasks.TypeDebit, unguarded.Transactional(pool, tasks.TypeDebit, tasks.DecodeDebit, debit))
	} else {
		mux.Handle(tasks.TypeCharge, asynqmw.Leased(w, tasks.TypeCharge, tasks.DecodeCharge, charge))
		mux.Handle(tasks.TypeDebit, asynqmw.Transactional(w, tasks.TypeDebit, tasks.DecodeDebit, debit))
	}

	acfg := workerconf.AsynqConfig(cfg.Concurrency, queues, cfg.ShutdownTimeout)
	acfg.Logger = asynqLogger{log.With("component", "asynq")}
	acfg.LogLevel = asynqLevel(cfg.LogLevel)
	acfg.ErrorHandler = asynq.ErrorHandlerFunc(func(ctx context.Context, t *asynq.Task, err error) {
		switch {
		case asynqmw.IsFailure(err):
			log.Warn("task failed", "task_type", t.Type(), "err", err)
		case idempotency.IsUnavailable(err):
			log.Warn("Postgres unavailable; retrying the task soon", "task_type", t.Type(), "err", err)
		default:
			log.Debug("task busy; retrying soon", "task_type", t.Type(), "err", err)
		}
	})
	srv := asynq.NewServerFromRedisClient(rdb, acfg)
	m.Registry.MustRegister(metrics.NewQueueCollector(asynq.NewInspectorFromRedisClient(rdb)))

	if err := srv.Start(asynqmw.ArchiveUnknown(mux, tasks.TypeCharge, tasks.TypeDebit)); err != nil {
		return fmt.Errorf("start asynq server: %w", err)
	}
	log.Info("worker started", "concurrency", cfg.Concurrency, "queues", cfg.Queues, "lease", cfg.Lease, "lock_ttl", cfg.LockTTL)

	httpErr := make(chan error, 1)
	if metricsLn != nil {
		h := m.Handler(map[string]metrics.Check{
			"redis":    func(ctx context.Context) error { return rdb.Ping(ctx).Err() },
			"postgres": func(ctx context.Context) error { return pool.Ping(ctx) },
		}, log)
		go func() {
			httpErr <- httpserver.Serve(ctx, cfg.MetricsAddr, h, log, &httpserver.Options{ShutdownTimeout: 5 * time.Second, Listener: metricsLn})
		}()
	}
	// One replica an hour purges: whichever takes the purge lock, left to expire.
	go ledger.RunRetention(ctx, idempotency.RetentionConfig{OlderThan: cfg.Retention, Every: purgeInterval, Logger: log,
		Turn: func(ctx context.Context) bool {
			_, err := locker.Obtain(ctx, "idemq:purge", purgeInterval, nil)
			return err == nil
		}})

	// Every replica runs the outbox relay and reconciler: they take disjoint batches.
	client := outbox.NewClient(pool, rdb, &outbox.Config{
		Grace:  cfg.ReconcileGrace,
		Listen: db.Session,
		Logger: log.With("component", "outbox"),
		Observe: func(ev outbox.Event, taskType string) {
			m.ObserveOutbox(string(ev), taskType)
			if ev == outbox.EventArchived {
				m.IntentsDead.WithLabelValues("archived", taskType).Inc()
			}
		},
	})
	m.Registry.MustRegister(metrics.NewOutboxCollector(client, cfg.ReconcileGrace))
	go client.RunRelay(ctx)
	go client.RunReconciler(ctx)

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-httpErr:
		runErr = fmt.Errorf("metrics server: %w", runErr)
	}
	log.Info("draining", "shutdown_timeout", cfg.ShutdownTimeout)
	w.Stop() // deliveries waiting for a scope's lock answer busy: another replica runs them
	srv.Shutdown()
	w.Wait() // the last deliveries' locks go back to Redis before it is closed
	log.Info("worker stopped")
	return runErr
}

// minRetention is asynq's task retention of the example tasks plus their longest retry
// horizon (asynq's default backoff at its worst) plus the busy budget.
func minRetention(busyBudget time.Duration) time.Duration {
	var horizon time.Duration
	for n := 0; n < tasks.DefaultMaxRetry; n++ {
		// asynq.DefaultRetryDelayFunc: n^4 + 15 + rand(30)*(n+1) seconds.
		horizon += time.Duration(n*n*n*n+15+29*(n+1)) * time.Second
	}
	return tasks.DefaultRetention + horizon + busyBudget
}

// asynqLogger feeds asynq's log lines to slog.
type asynqLogger struct{ l *slog.Logger }

func (a asynqLogger) Debug(args ...any) { a.l.Debug(fmt.Sprint(args...)) }
func (a asynqLogger) Info(args ...any)  { a.l.Info(fmt.Sprint(args...)) }
func (a asynqLogger) Warn(args ...any)  { a.l.Warn(fmt.Sprint(args...)) }
func (a asynqLogger) Error(args ...any) { a.l.Error(fmt.Sprint(args...)) }
func (a asynqLogger) Fatal(args ...any) { a.l.Error(fmt.Sprint(args...)); os.Exit(1) }

func asynqLevel(level string) asynq.LogLevel {
	switch level {
	case "debug":
		return asynq.DebugLevel
	case "warn":
		return asynq.WarnLevel
	case "error":
		return asynq.ErrorLevel
	}
	return asynq.InfoLevel
}
