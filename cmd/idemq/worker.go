package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"runtime"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/handlers"
	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/idempotency/server"
	"github.com/idemq/idemq/internal/config"
	"github.com/idemq/idemq/internal/dial"
	"github.com/idemq/idemq/internal/httpserver"
	"github.com/idemq/idemq/internal/metrics"
	"github.com/idemq/idemq/internal/process"
	"github.com/idemq/idemq/internal/tracing"
	"github.com/idemq/idemq/internal/unguarded"
	"github.com/idemq/idemq/tasks"
)

// needsAttentionEvery is how often a worker counts the ledger's needs_attention rows for
// its gauge: a scan of processed_jobs, so not at every scrape.
const needsAttentionEvery = 30 * time.Second

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

func runWorker(ctx context.Context, cfg *config.Worker, log *slog.Logger) error {
	queues, err := config.QueueWeights(cfg.Queues)
	if err != nil {
		return fmt.Errorf("IDEMQ_QUEUES: %w", err)
	}
	if d := cfg.DebitDriver; d != "" && d != "pgx" && d != "sql" {
		return fmt.Errorf("IDEMQ_DEBIT_DRIVER=%q: want pgx or sql", d)
	}
	// The server refuses a short retention too; this names the variables.
	busyBudget := max(2*cfg.Lease, cfg.BusyBudget)
	if min := server.MinRetention(cfg.TaskRetention, cfg.TaskMaxRetry, busyBudget); cfg.Retention < min {
		return fmt.Errorf("IDEMQ_RETENTION=%s is shorter than asynq's task retention plus the longest retry horizon plus the busy budget "+
			"(IDEMQ_TASK_RETENTION=%s, IDEMQ_TASK_MAX_RETRY=%d, IDEMQ_BUSY_BUDGET=%s: %s): a retried task could run again after its key was purged",
			cfg.Retention, cfg.TaskRetention, cfg.TaskMaxRetry, busyBudget, min.Round(time.Second))
	}

	// The metrics address is taken before anything else: a second worker on one host
	// given the same one stops here, before it takes a task.
	var metricsLn net.Listener
	if cfg.MetricsAddr != "" {
		metricsLn, err = net.Listen("tcp", cfg.MetricsAddr)
		if err != nil {
			return fmt.Errorf("IDEMQ_METRICS_ADDR=%s: %w: each worker and scheduler on one host needs an address of its own "+
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
	db, err := dial.OpenDatabase(ctx, cfg.DatabaseURL, cfg.DirectDatabaseURL, server.PoolSize(cfg.Concurrency, runtime.GOMAXPROCS(0)), log)
	if err != nil {
		return err
	}
	defer db.Close()
	pool := db.Pool
	if err := requireSchema(ctx, pool, "worker", exampleSchema); err != nil {
		return err
	}
	reg := process.Start(ctx, pool, process.RoleWorker, log, nil)
	defer reg.Stop()

	m := metrics.New()
	if cfg.UnsafeNoFencing {
		log.Warn("IDEMQ_UNSAFE_NO_FENCING is set: stale owners can complete and extend leases they lost (tests only)")
	}
	s, err := server.New(server.Config{
		Postgres:        pool,
		Redis:           rdb,
		Concurrency:     cfg.Concurrency,
		Queues:          queues,
		Lease:           cfg.Lease,
		ShutdownTimeout: cfg.ShutdownTimeout,
		Retention:       cfg.Retention,
		TaskRetention:   cfg.TaskRetention,
		TaskMaxRetry:    cfg.TaskMaxRetry,
		ReconcileGrace:  cfg.ReconcileGrace,
		Logger:          log,
		Ledger: &idempotency.Config{
			MaxAge:             cfg.MaxAge,
			HeartbeatPool:      db.Heartbeats,
			UnsafeNoFencing:    cfg.UnsafeNoFencing,
			NoDuplicateHistory: !cfg.HistoryDuplicates,
			DisableGroupCommit: !cfg.GroupCommit,
			Observe: func(ev idempotency.Event, taskType string) {
				m.ObserveLedger(string(ev), taskType)
			},
			ObserveBatch:        m.ObserveBatch,
			ObserveHistory:      m.ObserveHistory,
			ObservePurge:        m.ObservePurge,
			ObservePurgeBacklog: m.ObservePurgeBacklog,
			ObserveStep: func(taskType, step string, outcome idempotency.StepOutcome) {
				m.ObserveStep(taskType, step, string(outcome))
			},
		},
		Worker: &asynqmw.Config{
			LockTTL:    cfg.LockTTL,
			BusyBudget: busyBudget,
			ObserveLock: func(ev asynqmw.LockEvent, taskType string) {
				m.ObserveLock(string(ev), taskType)
			},
			ObserveHandler: m.ObserveHandler,
			ObserveIntentDead: func(taskType, reason string) {
				m.IntentsDead.WithLabelValues(reason, taskType).Inc()
			},
		},
		ObserveRecovered: func(taskType string) {
			m.AsynqRecovered.WithLabelValues(taskType).Inc()
		},
		ObserveOverBudget: func(taskType, reason string) {
			m.OverBudget.WithLabelValues(reason, taskType).Inc()
		},
		Outbox: &outbox.Config{
			Listen: db.Session,
			Observe: func(ev outbox.Event, taskType string) {
				m.ObserveOutbox(string(ev), taskType)
				if ev == outbox.EventArchived {
					m.IntentsDead.WithLabelValues("archived", taskType).Inc()
				}
			},
		},
	})
	if err != nil {
		return err
	}
	m.Registry.MustRegister(metrics.NewQueueCollector(asynq.NewInspectorFromRedisClient(rdb)))
	m.Registry.MustRegister(metrics.NewOutboxCollector(s.Outbox(), cfg.ReconcileGrace))
	m.Registry.MustRegister(metrics.NewLedgerCollector(s.Ledger(), needsAttentionEvery))

	charger := handlers.NewCharger(cfg.FakepayURL, tracing.Client(handlers.DefaultClient())).WithFenceMargin(s.Ledger().SelfFenceMargin())
	charge := func(ctx context.Context, c tasks.Charge) (json.RawMessage, error) {
		return charger.Charge(ctx, c.Key(), c)
	}
	fp, err := parseFaultPoints(cfg.UnsafeFaults)
	if err != nil {
		return fmt.Errorf("IDEMQ_UNSAFE_FAULTS: %w", err)
	}
	charge = fp.wrap(charge, log)
	debit := wrapDebit(fp, handlers.Debit, log)
	if cfg.UnsafeNoGuards {
		log.Warn("IDEMQ_UNSAFE_NO_GUARDS is set: no lock, no ledger, no step records; duplicate deliveries take effect twice")
		s.Handle(tasks.TypeCharge, unguarded.Leased(tasks.TypeCharge, tasks.DecodeCharge, charge))
		if cfg.DebitDriver == "sql" {
			db := stdlib.OpenDBFromPool(pool)
			defer db.Close()
			s.Handle(tasks.TypeDebit, unguarded.TransactionalSQL(db, tasks.TypeDebit, tasks.DecodeDebit, wrapDebit(fp, handlers.DebitSQL, log)))
		} else {
			s.Handle(tasks.TypeDebit, unguarded.Transactional(pool, tasks.TypeDebit, tasks.DecodeDebit, debit))
		}
		// The same three effects without step records: a redelivery records and emails again.
		s.Handle(tasks.TypeCheckout, unguarded.Leased(tasks.TypeCheckout, tasks.DecodeCheckout, unguarded.Checkout(charger, pool)))
		s.Handle(tasks.TypeSettle, unguarded.Transactional(pool, tasks.TypeSettle, tasks.DecodeSettle, handlers.Settle))
	} else {
		server.HandleLeased(s, tasks.TypeCharge, charge, server.WithDecoder(tasks.DecodeCharge))
		if cfg.DebitDriver == "sql" {
			server.HandleSQLTx(s, tasks.TypeDebit, wrapDebit(fp, handlers.DebitSQL, log), server.WithDecoder(tasks.DecodeDebit))
		} else {
			server.HandleTx(s, tasks.TypeDebit, debit, server.WithDecoder(tasks.DecodeDebit))
		}
		server.HandleLeased(s, tasks.TypeCheckout, charger.Checkout, server.WithDecoder(tasks.DecodeCheckout))
		server.HandleTx(s, tasks.TypeSettle, handlers.Settle, server.WithDecoder(tasks.DecodeSettle))
	}

	m.Init(tasks.TypeCharge, tasks.TypeDebit, tasks.TypeCheckout, tasks.TypeSettle)
	log.Info("this worker owns the queues of IDEMQ_QUEUES: a task of any type but the example's found there is archived; "+
		"give your own task types a queue of their own, not in IDEMQ_QUEUES", "queues", cfg.Queues,
		"task_types", []string{tasks.TypeCharge, tasks.TypeDebit, tasks.TypeCheckout, tasks.TypeSettle})

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	httpErr := serveMetrics(runCtx, m, metricsLn, cfg.MetricsAddr, rdb, pool, log)
	runErr := make(chan error, 1)
	go func() { runErr <- s.Run(runCtx) }()
	select {
	case err := <-runErr:
		return err
	case err := <-httpErr:
		cancel() // drain
		if err := <-runErr; err != nil {
			return err
		}
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("metrics server: %w", err)
	}
}

// serveMetrics serves m's /metrics, /healthz and /readyz (Redis and Postgres answer) on ln
// until ctx ends, and sends the server's end on the channel it returns; with no ln
// (IDEMQ_METRICS_ADDR empty) it serves nothing and the channel never receives.
func serveMetrics(ctx context.Context, m *metrics.Metrics, ln net.Listener, addr string, rdb redis.UniversalClient, pool *pgxpool.Pool, log *slog.Logger) <-chan error {
	done := make(chan error, 1)
	if ln == nil {
		return done
	}
	h := m.Handler(map[string]metrics.Check{
		"redis":    func(ctx context.Context) error { return rdb.Ping(ctx).Err() },
		"postgres": func(ctx context.Context) error { return pool.Ping(ctx) },
	}, log)
	go func() {
		done <- httpserver.Serve(ctx, addr, h, log, &httpserver.Options{ShutdownTimeout: 5 * time.Second, Listener: ln})
	}()
	return done
}
