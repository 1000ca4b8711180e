// Command shop runs the shop's background jobs until SIGTERM.
//
//	shop migrate      apply idemq's migrations and the shop's
//	shop              run the worker
//	shop enqueue N    accept N refunds and N receipts (orders o-1 … o-N)
//
// It reads DATABASE_URL and REDIS_URL.
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"example.com/shop"
	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/idempotency/server"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, args []string) error {
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return err
	}
	defer pool.Close()
	if len(args) > 0 && args[0] == "migrate" {
		return shop.Migrate(ctx, stdlib.OpenDBFromPool(pool))
	}
	opt, err := redis.ParseURL(os.Getenv("REDIS_URL"))
	if err != nil {
		return err
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	if len(args) == 2 && args[0] == "enqueue" {
		n, err := strconv.Atoi(args[1])
		if err != nil {
			return err
		}
		return enqueue(ctx, outbox.NewClient(pool, rdb, nil), n)
	}

	srv, err := server.New(server.Config{Postgres: pool, Redis: rdb, Logger: slog.Default()})
	if err != nil {
		return err
	}
	shop.Register(srv, shop.Mailer{DB: pool})
	return srv.Run(ctx) // until SIGTERM, then it drains
}

// enqueue accepts a refund and a receipt for each of n orders. The calls run at once:
// the outbox records concurrent calls in shared transactions.
func enqueue(ctx context.Context, client *outbox.Client, n int) error {
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			order := fmt.Sprintf("o-%d", i+1)
			errs[i] = errors.Join(
				accept(ctx, client, shop.TypeRefund, shop.Refund{Order: order, Cents: 500}),
				accept(ctx, client, shop.TypeReceipt, shop.Receipt{Order: order, To: order + "@example.com"}))
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

func accept(ctx context.Context, client *outbox.Client, taskType string, job idempotency.Job) error {
	spec, err := shop.Spec(taskType, job)
	if err == nil {
		_, err = client.Enqueue(ctx, spec)
	}
	return err
}
