// Command sqlx is an idemq worker whose handler writes through sqlx, with lib/pq as the
// database/sql driver of its transactions: each ledger:posting job inserts its row with
// sqlx over the *sql.Tx the ledger hands the handler, so that the row and the job's
// ledger row commit together, once.
//
//	DATABASE_URL=postgres://… REDIS_URL=redis://… go run ./sqlx
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jmoiron/sqlx"
	"github.com/jmoiron/sqlx/reflectx"
	_ "github.com/lib/pq" // the "postgres" driver
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/examples/internal/posting"
	"github.com/idemq/idemq/idempotency/server"
	"github.com/idemq/idemq/migrations"
)

// Posting is a row of postings as sqlx maps it.
type Posting struct {
	ID      int64  `db:"id"`
	Account string `db:"account"`
	Cents   int64  `db:"cents"`
	Ref     string `db:"ref"`
}

// mapper is sqlx's default mapper (db tags, else the lowercased field name), which a
// sqlx.Tx built around a *sql.Tx does not get by itself.
var mapper = reflectx.NewMapperFunc("db", sqlx.NameMapper)

const insertPosting = `INSERT INTO postings (account, cents, ref) VALUES (:account, :cents, :ref)
	RETURNING id, account, cents, ref`

// register registers the worker's jobs: on its server.Server in main, on the harness's
// workers in the tests.
func register(r server.Registrar) {
	server.HandleSQLTx(r, posting.TaskType, post)
}

// post writes the posting through sqlx over tx, wrapped in a sqlx.Tx. Such a Tx has no
// driver name (the field is sqlx's own), so its NamedExec would bind with ?: the named
// query is bound for Postgres ($1, $2, …) with sqlx.BindNamed, and run with GetContext,
// which scans the returned row through the mapper. post must not commit or roll back tx:
// the ledger commits it with the job's row.
func post(ctx context.Context, tx *sql.Tx, p posting.Posting) (json.RawMessage, error) {
	stx := &sqlx.Tx{Tx: tx, Mapper: mapper}
	row := Posting{Account: p.Account, Cents: p.Cents, Ref: p.Ref}
	query, args, err := sqlx.BindNamed(sqlx.DOLLAR, insertPosting, row)
	if err != nil {
		return nil, err
	}
	if err := stx.GetContext(ctx, &row, query, args...); err != nil {
		return nil, err
	}
	return posting.Result(row.ID), nil
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx); err != nil {
		log.Fatal(err)
	}
}

// run migrates DATABASE_URL (idemq's tables and postings) and serves jobs from REDIS_URL
// until ctx ends.
func run(ctx context.Context) error {
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
	db, err := sqlx.Open("postgres", dsn) // lib/pq, for the handlers' transactions
	if err != nil {
		return err
	}
	defer db.Close()
	opt, err := redis.ParseURL(getenv("REDIS_URL", "redis://127.0.0.1:6379/0"))
	if err != nil {
		return err
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	srv, err := server.New(server.Config{Postgres: pool, Redis: rdb, SQL: db.DB})
	if err != nil {
		return err
	}
	register(srv)
	return srv.Run(ctx)
}

func getenv(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
