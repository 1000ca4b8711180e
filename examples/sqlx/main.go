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

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jmoiron/sqlx"
	"github.com/jmoiron/sqlx/reflectx"
	_ "github.com/lib/pq" // the "postgres" driver

	"github.com/idemq/idemq/examples/internal/posting"
	"github.com/idemq/idemq/examples/internal/worker"
	"github.com/idemq/idemq/idempotency/server"
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
	// The handlers' transactions on lib/pq (server.Config.SQL).
	worker.Main(func(_ context.Context, dsn string, _ *pgxpool.Pool) (*sql.DB, error) {
		db, err := sqlx.Open("postgres", dsn)
		if err != nil {
			return nil, err
		}
		return db.DB, nil
	}, func(_ *sql.DB, r server.Registrar) { register(r) })
}
