package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/api"
	"github.com/idemq/idemq/internal/config"
	"github.com/idemq/idemq/internal/dial"
	"github.com/idemq/idemq/internal/httpserver"
	"github.com/idemq/idemq/internal/metrics"
	"github.com/idemq/idemq/internal/process"
	"github.com/idemq/idemq/internal/tracing"
)

func apiCommand() command {
	return command{
		name:    "api",
		usage:   "api",
		summary: "serve the enqueue API, the asynqmon dashboard (/monitoring/), the ledger page (/ledger/) and /metrics",
		spec:    func() any { return &config.API{} },
		traced:  "idemq-api",
		run: func(ctx context.Context, spec any, args []string, _, stderr io.Writer) error {
			if len(args) > 0 {
				return fmt.Errorf("api: unexpected arguments %q", args)
			}
			cfg := spec.(*config.API)
			return runAPI(ctx, cfg, newLogger(stderr, cfg.LogLevel).With("cmd", "api"))
		},
	}
}

func runAPI(ctx context.Context, cfg *config.API, log *slog.Logger) error {
	if cfg.DashboardPassword != "" && cfg.DashboardPassword != api.PlaceholderPassword && cfg.DashboardUser == "" {
		return errors.New("api: IDEMQ_DASHBOARD_PASSWORD is set but IDEMQ_DASHBOARD_USER is empty: set the user name the dashboard and the ledger page admit")
	}
	ln, err := listen("IDEMQ_HTTP_ADDR", cfg.HTTPAddr)
	if err != nil {
		return err
	}
	defer ln.Close() // Serve closes it too
	stopTracing, err := startTracing(ctx, "idemq-api", log)
	if err != nil {
		return err
	}
	defer stopTracing()
	connOpt, err := dial.AsynqRedis(cfg.RedisURL, cfg.RedisCluster)
	if err != nil {
		return err
	}
	rdb, err := dial.Redis(ctx, cfg.RedisURL, cfg.RedisCluster)
	if err != nil {
		return err
	}
	defer rdb.Close()
	db, err := dial.OpenDatabase(ctx, cfg.DatabaseURL, cfg.DirectDatabaseURL, cfg.PoolSize, log)
	if err != nil {
		return err
	}
	defer db.Close()
	pool := db.Pool
	if err := requireSchema(ctx, pool, "api", exampleSchema); err != nil {
		return err
	}
	reg := process.Start(ctx, pool, process.RoleAPI, log, nil)
	defer reg.Stop()

	m := metrics.New()
	// The API only reads the ledger: no heartbeats, so no pool of their own.
	ledger := idempotency.New(pool, &idempotency.Config{Logger: log, HeartbeatPool: pool})
	defer ledger.Close()
	client := outbox.NewClient(pool, rdb, &outbox.Config{Listen: db.Session, Logger: log})
	m.Registry.MustRegister(metrics.NewQueueCollector(asynq.NewInspectorFromRedisClient(rdb)))

	h := api.New(api.Deps{Pool: pool, Redis: rdb, Ledger: ledger, Enqueuer: client, Metrics: m}, &api.Options{
		RedisConnOpt:      connOpt,
		DashboardUser:     cfg.DashboardUser,
		DashboardPassword: cfg.DashboardPassword,
		ListenAddr:        cfg.HTTPAddr,
		APITokens:         config.APITokens(cfg.APIToken),
		DashboardActions:  !cfg.DashboardReadonly,
		TraceURLTemplate:  cfg.TraceURLTemplate,
		Logger:            log,
	})
	defer h.Close()
	switch h.Dashboard() {
	case api.AccessRefused:
		log.Warn("IDEMQ_DASHBOARD_PASSWORD is not set (or is the placeholder "+api.PlaceholderPassword+") and IDEMQ_HTTP_ADDR is not a loopback address: "+
			"/monitoring/, /ledger/ and /schedule/ answer 403 until IDEMQ_DASHBOARD_USER and IDEMQ_DASHBOARD_PASSWORD are set; /v1/, /metrics, /healthz and /readyz are served", "addr", cfg.HTTPAddr)
	case api.AccessLoopback:
		log.Warn("IDEMQ_DASHBOARD_PASSWORD is not set: /monitoring/ and /ledger/ are open without a password to anyone on this machine "+
			"(for requests to localhost or a loopback address; any other Host gets 421)", "addr", cfg.HTTPAddr)
	case api.AccessPassword:
		log.Info("/monitoring/ and /ledger/ ask for basic auth as IDEMQ_DASHBOARD_USER with IDEMQ_DASHBOARD_PASSWORD", "user", cfg.DashboardUser)
	}
	switch h.API() {
	case api.AccessRefused:
		log.Warn("IDEMQ_API_TOKEN is not set (or is the placeholder "+api.PlaceholderPassword+") and IDEMQ_HTTP_ADDR is not a loopback address: "+
			"/v1/ answers 403 until a token is set", "addr", cfg.HTTPAddr)
	case api.AccessLoopback:
		log.Warn("IDEMQ_API_TOKEN is not set: /v1/ is open without a token to anyone on this machine "+
			"(for requests to localhost or a loopback address; any other Host gets 421)", "addr", cfg.HTTPAddr)
	case api.AccessToken:
		log.Info("/v1/ asks for a bearer token of IDEMQ_API_TOKEN", "tokens", len(config.APITokens(cfg.APIToken)))
	}

	// The API's relay publishes what it accepted at once (woken after each commit); the
	// workers' replicas may run relays too, they take disjoint batches.
	go h.PurgeKeysEvery(ctx, cfg.PurgeInterval, cfg.KeyRetention)

	relayCtx, stopRelay := context.WithCancel(ctx)
	defer stopRelay()
	relayDone := make(chan error, 1)
	go func() { relayDone <- client.RunRelay(relayCtx) }()

	err = httpserver.Serve(ctx, cfg.HTTPAddr, tracing.Handler(h, "idemq-api"), log, &httpserver.Options{
		Listener:        ln,
		ShutdownTimeout: cfg.ShutdownTimeout,
		IdleTimeout:     cfg.HTTPIdleTimeout,
		MaxConns:        cfg.HTTPMaxConns,
	})
	stopRelay()
	if err != nil {
		err = fmt.Errorf("api: %w", err)
	}
	select {
	case <-relayDone:
	case <-time.After(5 * time.Second):
		log.Warn("relay did not stop within 5s")
	}
	log.Info("api stopped")
	return err
}
