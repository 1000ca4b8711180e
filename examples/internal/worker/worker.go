// Package worker is what every example's main does around its handler: it runs an idemq
// worker until SIGINT or SIGTERM.
package worker

import (
	"context"
	"database/sql"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/examples/internal/posting"
	"github.com/idemq/idemq/idempotency/server"
	"github.com/idemq/idemq/migrations"
)

// Main runs a worker until SIGINT or SIGTERM, and exits the program on an error: a pool on
// DATABASE_URL, migrated with idemq's migrations and the postings table, Redis from
// REDIS_URL, and a server.Server whose handlers' transactions come from open's *sql.DB
// (server.Config.SQL; nil open: pgx's stdlib over the pool, the server's default), with
// the jobs register registers (db is open's *sql.DB, or nil).
func Main(open func(ctx context.Context, dsn string, pool *pgxpool.Pool) (*sql.DB, error), register func(db *sql.DB, r server.Registrar)) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, open, register); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, open func(context.Context, string, *pgxpool.Pool) (*sql.DB, error), register func(*sql.DB, server.Registrar)) error {
	dsn := getenv("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
	pool, err := pgxpool.New(ctx, dsn) // the ledger's own pool
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := migrations.UpPool(ctx, pool); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, posting.Schema); err != nil {
		return err
	}
	var db *sql.DB
	if open != nil {
		if db, err = open(ctx, dsn, pool); err != nil {
			return err
		}
		defer db.Close()
	}
	opt, err := redis.ParseURL(getenv("REDIS_URL", "redis://127.0.0.1:6379/0"))
	if err != nil {
		return err
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	srv, err := server.New(server.Config{Postgres: pool, Redis: rdb, SQL: db})
	if err != nil {
		return err
	}
	register(db, srv)
	return srv.Run(ctx)
}

func getenv(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
