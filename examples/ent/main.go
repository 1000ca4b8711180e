// Command ent is an idemq worker whose handler writes through ent: each ledger:posting
// job creates its row with an ent client over the *sql.Tx the ledger hands the handler,
// so that the row and the job's ledger row commit together, once. Package ent (./ent) is
// generated from ./ent/schema: go generate ./ent/...
//
//	DATABASE_URL=postgres://… REDIS_URL=redis://… go run ./ent
package main

import (
	"context"
	"database/sql"
	"encoding/json"

	"entgo.io/ent/dialect"
	entsql "entgo.io/ent/dialect/sql"

	"github.com/idemq/idemq/examples/ent/ent"
	"github.com/idemq/idemq/examples/internal/posting"
	"github.com/idemq/idemq/examples/internal/worker"
	"github.com/idemq/idemq/idempotency/server"
)

// register registers the worker's jobs: on its server.Server in main, on the harness's
// workers in the test.
func register(r server.Registrar) {
	server.HandleSQLTx(r, posting.TaskType, post)
}

// post creates the posting with an ent client whose driver runs every statement on tx
// (entsql.Conn{ExecQuerier: tx}, as ent's documentation does for a migration's
// transaction). post must not commit or roll back tx: the ledger commits it with the
// job's row.
func post(ctx context.Context, tx *sql.Tx, p posting.Posting) (json.RawMessage, error) {
	client := ent.NewClient(ent.Driver(onTx{entsql.NewDriver(dialect.Postgres, entsql.Conn{ExecQuerier: tx})}))
	row, err := client.Posting.Create().SetAccount(p.Account).SetCents(p.Cents).SetRef(p.Ref).Save(ctx)
	if err != nil {
		return nil, err
	}
	return posting.Result(int64(row.ID)), nil
}

// onTx is an ent driver on the delivery's transaction. ent begins a transaction of its
// own for writes of several statements (a create with edges) and for client.Tx, which
// entsql.Driver would begin on a *sql.DB it does not have here (it panics): onTx gives
// ent the delivery's transaction instead, which ent's commit and rollback leave open
// (dialect.NopTx). A rollback there undoes nothing: return the error, and the ledger
// rolls the whole delivery back.
type onTx struct{ *entsql.Driver }

func (d onTx) Tx(context.Context) (dialect.Tx, error) { return dialect.NopTx(d.Driver), nil }

func (d onTx) BeginTx(ctx context.Context, _ *entsql.TxOptions) (dialect.Tx, error) {
	return d.Tx(ctx)
}

func main() {
	// The handlers' *sql.DB (server.Config.SQL) is, by default, pgx's stdlib over the pool.
	worker.Main(nil, func(_ *sql.DB, r server.Registrar) { register(r) })
}
