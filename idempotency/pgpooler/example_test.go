package pgpooler_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency/pgpooler"
)

// Check at start whether DATABASE_URL reaches a transaction-mode pooler, where a LISTEN
// or a session advisory lock would silently do nothing.
func ExampleDetect() {
	cfg, err := pgx.ParseConfig("postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kind, err := pgpooler.Detect(ctx, cfg)
	if err != nil {
		fmt.Println("cannot tell:", err)
		return
	}
	if kind == pgpooler.TransactionPooler {
		fmt.Println("use a direct URL for LISTEN and migrations")
	}
}
