// Command gorm is an idemq worker whose handler writes through GORM: each ledger:posting
// job inserts its row with GORM over the *sql.Tx the ledger hands the handler, so that the
// row and the job's ledger row commit together, once.
//
//	DATABASE_URL=postgres://… REDIS_URL=redis://… go run ./gorm
package main

import (
	"context"
	"database/sql"
	"encoding/json"

	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/idemq/idemq/examples/internal/posting"
	"github.com/idemq/idemq/examples/internal/worker"
	"github.com/idemq/idemq/idempotency/server"
)

// Posting is GORM's model of a row of postings.
type Posting struct {
	ID      int64
	Account string
	Cents   int64
	Ref     string
}

// register registers the worker's jobs: on its server.Server in main, on the harness's
// workers in the test.
func register(r server.Registrar) {
	server.HandleSQLTx(r, posting.TaskType, post)
}

// post writes the posting through GORM over tx. GORM takes tx as its connection
// (postgres.Config.Conn is any gorm.ConnPool, which *sql.Tx is), and with
// SkipDefaultTransaction it wraps the insert in no transaction of its own. post must not
// commit or roll back tx: the ledger commits it with the job's row.
func post(ctx context.Context, tx *sql.Tx, p posting.Posting) (json.RawMessage, error) {
	db, err := gorm.Open(postgres.New(postgres.Config{Conn: tx}), &gorm.Config{
		SkipDefaultTransaction: true,
		Logger:                 logger.Discard, // an error reaches the worker's log as post's
	})
	if err != nil {
		return nil, err
	}
	row := Posting{Account: p.Account, Cents: p.Cents, Ref: p.Ref}
	if err := db.WithContext(ctx).Create(&row).Error; err != nil {
		return nil, err
	}
	return posting.Result(row.ID), nil
}

func main() {
	// The handlers' *sql.DB (server.Config.SQL) is, by default, pgx's stdlib over the pool.
	worker.Main(nil, func(_ *sql.DB, r server.Registrar) { register(r) })
}
