// Command bun is an idemq worker whose handler writes through bun: each ledger:posting
// job inserts its row with bun's query builder, run on the *sql.Tx the ledger hands the
// handler, so that the row and the job's ledger row commit together, once.
//
//	DATABASE_URL=postgres://… REDIS_URL=redis://… go run ./bun
package main

import (
	"context"
	"database/sql"
	"encoding/json"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect/pgdialect"

	"github.com/idemq/idemq/examples/internal/posting"
	"github.com/idemq/idemq/examples/internal/worker"
	"github.com/idemq/idemq/idempotency/server"
)

// Posting is bun's model of a row of postings.
type Posting struct {
	bun.BaseModel `bun:"table:postings"`

	ID      int64  `bun:"id,pk,autoincrement"`
	Account string `bun:"account,notnull"`
	Cents   int64  `bun:"cents,notnull"`
	Ref     string `bun:"ref,notnull"`
}

// app is what the handlers share: bun's DB, which builds their queries. bun.NewDB wants a
// *sql.DB; the handlers' queries run on the delivery's tx (Conn), never on it.
type app struct{ db *bun.DB }

// register registers the worker's jobs: on its server.Server in main, on the harness's
// workers in the test.
func (a app) register(r server.Registrar) {
	server.HandleSQLTx(r, posting.TaskType, a.post)
}

// post inserts the posting with bun on tx: Conn(tx) runs the query on the delivery's
// transaction (bun.IConn takes a *sql.Tx). Without it, the insert would commit on its
// own, outside the ledger's transaction. post must not commit or roll back tx: the
// ledger commits it with the job's row.
func (a app) post(ctx context.Context, tx *sql.Tx, p posting.Posting) (json.RawMessage, error) {
	row := &Posting{Account: p.Account, Cents: p.Cents, Ref: p.Ref}
	if _, err := a.db.NewInsert().Conn(tx).Model(row).Returning("id").Exec(ctx); err != nil {
		return nil, err
	}
	return posting.Result(row.ID), nil
}

func main() {
	// One *sql.DB for bun and the handlers' transactions (server.Config.SQL).
	worker.Main(func(_ context.Context, _ string, pool *pgxpool.Pool) (*sql.DB, error) {
		return stdlib.OpenDBFromPool(pool), nil
	}, func(db *sql.DB, r server.Registrar) { app{db: bun.NewDB(db, pgdialect.New())}.register(r) })
}
