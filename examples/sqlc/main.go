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

	"github.com/idemq/idemq/examples/internal/posting"
	"github.com/idemq/idemq/examples/internal/worker"
	"github.com/idemq/idemq/examples/sqlc/postings"
	"github.com/idemq/idemq/idempotency/server"
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
	// The handlers' *sql.DB (server.Config.SQL) is, by default, pgx's stdlib over the pool.
	worker.Main(nil, func(_ *sql.DB, r server.Registrar) { register(r) })
}
