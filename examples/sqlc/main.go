// Command sqlc is an idemq worker whose handler writes through code sqlc generated for
// database/sql (./postings, from query.sql and schema.sql): each ledger:posting job
// inserts its row with the generated CreatePosting on the *sql.Tx the ledger hands the
// handler, so that the row and the job's ledger row commit together, once.
//
//	DATABASE_URL=postgres://… REDIS_URL=redis://… go run ./sqlc
package main

//go:generate sqlc generate

import (
	"context"
	"database/sql"
	"encoding/json"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/examples/internal/posting"
	"github.com/idemq/idemq/examples/sqlc/postings"
	"github.com/idemq/idemq/idempotency/server"
	"github.com/idemq/idemq/migrations"
)

// register registers the worker's jobs: on its server.Server in main, on the harness's
// workers in the test.
func register(r server.Registrar) {
	server.HandleSQLTx(r, posting.TaskType, post)
}

// post inserts the posting with sqlc's generated query on tx: New takes any DBTX, which
// *sql.Tx is (an application holding Queries over its *sql.DB would call WithTx(tx)).
// post must not commit or roll back tx: the ledger commits it with the job's row.
func post(ctx context.Context, tx *sql.Tx, p posting.Posting) (json.RawMessage, error) {
	id, err := postings.New(tx).CreatePosting(ctx, postings.CreatePostingParams{Account: p.Account, Cents: p.Cents, Ref: p.Ref})
	if err != nil {
		return nil, err
	}
	return posting.Result(id), nil
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
	pool, err := pgxpool.New(ctx, getenv("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"))
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
	opt, err := redis.ParseURL(getenv("REDIS_URL", "redis://127.0.0.1:6379/0"))
	if err != nil {
		return err
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	// The handlers' *sql.DB (server.Config.SQL) is, by default, pgx's stdlib over pool.
	srv, err := server.New(server.Config{Postgres: pool, Redis: rdb})
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
