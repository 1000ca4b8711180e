package bench

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/handlers"
	"github.com/idemq/idemq/internal/unguarded"
	"github.com/idemq/idemq/tasks"
)

// runBareChild is drain mode's bare asynq worker, in a process of its own: a plain
// asynq.Server (default asynq.Config but Concurrency) on REDIS_URL, and for debits a
// default pgx pool on DATABASE_URL whose every delivery INSERTs its wallet entry in a
// transaction of its own; for charges the same HTTP call to the provider the worker makes;
// for checkouts the worker's three effects with no step records (unguarded.Checkout: the
// charge, the order's row in a transaction of its own, the receipt). No lock, no ledger.
// It serves until ctx ends.
func runBareChild(ctx context.Context, redisURL, databaseURL string, args []string, _, stderr io.Writer) error {
	fs := flag.NewFlagSet("idemq-bench "+bareChildFlag, flag.ContinueOnError)
	fs.SetOutput(stderr)
	conc := fs.Int("concurrency", 10, "asynq concurrency")
	fakepayURL := fs.String("fakepay", "", "the provider's base URL (charges and checkouts)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	opt, err := redis.ParseURL(redisURL)
	if err != nil {
		return fmt.Errorf("bench: REDIS_URL: %w", err)
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		return fmt.Errorf("bench: DATABASE_URL: %w", err)
	}
	defer pool.Close()
	charger := handlers.NewCharger(*fakepayURL, nil)
	mux := asynq.NewServeMux()
	mux.HandleFunc(tasks.TypeDebit, func(ctx context.Context, t *asynq.Task) error {
		var d tasks.Debit
		if err := json.Unmarshal(t.Payload(), &d); err != nil {
			return fmt.Errorf("%v: %w", err, asynq.SkipRetry)
		}
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO wallet_entries (account_id, amount_cents, reference, fence) VALUES ($1, $2, $3, 0)`,
				d.AccountID, d.AmountCents, d.Reference)
			return err
		})
	})
	mux.HandleFunc(tasks.TypeCharge, func(ctx context.Context, t *asynq.Task) error {
		var c tasks.Charge
		if err := json.Unmarshal(t.Payload(), &c); err != nil {
			return fmt.Errorf("%v: %w", err, asynq.SkipRetry)
		}
		_, err := charger.Charge(ctx, c.Key(), c)
		return err
	})
	mux.Handle(tasks.TypeCheckout, unguarded.Leased(tasks.TypeCheckout, tasks.DecodeCheckout, unguarded.Checkout(charger, pool)))
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{Concurrency: *conc, LogLevel: asynq.FatalLevel})
	if err := srv.Start(mux); err != nil {
		return err
	}
	<-ctx.Done()
	srv.Shutdown()
	return nil
}
