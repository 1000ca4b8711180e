package api_test

import (
	"context"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/api"
	"github.com/idemq/idemq/internal/httpserver"
	"github.com/idemq/idemq/internal/metrics"
)

// Example wires the API as `idemq api` does: a Client records intents and its relay
// publishes them; the handler serves the enqueue API, the dashboard and /metrics.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer rdb.Close()

	ledger := idempotency.New(pool, nil)
	defer ledger.Close()
	client := outbox.NewClient(pool, rdb, nil)
	go client.RunRelay(ctx)

	h := api.New(api.Deps{Pool: pool, Redis: rdb, Ledger: ledger, Enqueuer: client, Metrics: metrics.New()},
		&api.Options{
			RedisConnOpt:      asynq.RedisClientOpt{Addr: "127.0.0.1:6379"},
			DashboardUser:     "ops",
			DashboardPassword: os.Getenv("IDEMQ_DASHBOARD_PASSWORD"),
			APITokens:         strings.Split(os.Getenv("IDEMQ_API_TOKEN"), ","),
			ListenAddr:        ":8080", // not loopback: without a password, /monitoring/ and /ledger/ answer 403, without a token /v1/ does
		})
	defer h.Close()
	go h.PurgeKeysEvery(ctx, time.Hour, 24*time.Hour)
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := httpserver.Serve(ctx, ":8080", h, log, &httpserver.Options{ShutdownTimeout: 30 * time.Second}); err != nil {
		log.Error("api", "err", err)
	}
}
