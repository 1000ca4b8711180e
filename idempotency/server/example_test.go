package server_test

import (
	"context"
	"encoding/json"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/server"
	"github.com/idemq/idemq/migrations"
)

// Debit takes an amount from an account, once per reference. A job needs a key from
// intent and a lock scope; its Validate, if any, refuses bad payloads.
type Debit struct {
	Account string `json:"account"`
	Cents   int64  `json:"cents"`
	Ref     string `json:"ref"`
}

func (d Debit) Key() string       { return "debit:" + d.Ref }
func (d Debit) LockScope() string { return "account:" + d.Account }

// Receipt sends an order's receipt by email, once per order.
type Receipt struct {
	Order string `json:"order"`
	To    string `json:"to"`
}

func (r Receipt) Key() string       { return "receipt:" + r.Order }
func (r Receipt) LockScope() string { return r.Key() }

// sendEmail calls your provider with key as its idempotency key.
func sendEmail(ctx context.Context, key string, r Receipt) error { return nil }

func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	if _, err := migrations.UpPool(ctx, pool); err != nil { // idemq's tables, beside yours
		log.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"}) // the Redis asynq uses
	srv, err := server.New(server.Config{Postgres: pool, Redis: rdb})
	if err != nil {
		log.Fatal(err)
	}
	server.HandleTx(srv, "wallet:debit", func(ctx context.Context, tx pgx.Tx, d Debit) (json.RawMessage, error) {
		_, err := tx.Exec(ctx, `INSERT INTO debits (account, cents, ref) VALUES ($1, $2, $3)`, d.Account, d.Cents, d.Ref)
		return nil, err // the row and the key's completion commit together
	})
	server.HandleLeased(srv, "email:receipt", func(ctx context.Context, r Receipt) (json.RawMessage, error) {
		key, _, _ := idempotency.FromContext(ctx)
		return nil, sendEmail(ctx, key, r) // a retry sends the same key: the provider dedups
	})
	if err := srv.Run(ctx); err != nil { // until SIGTERM, then it drains
		log.Fatal(err)
	}
}
