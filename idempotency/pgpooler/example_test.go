package pgpooler_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency/pgpooler"
	"github.com/idemq/idemq/internal/testenv"
)

// Check at start whether DATABASE_URL reaches a transaction-mode pooler, where a LISTEN
// or a session advisory lock would silently do nothing.
func ExampleDetect() {
	cfg, err := pgx.ParseConfig(testenv.ServerURL()) // DATABASE_URL: Postgres itself here
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kind, err := pgpooler.Detect(ctx, cfg)
	if err != nil {
		fmt.Println("cannot tell:", err)
		return
	}
	fmt.Println("reaches:", kind)
	if kind == pgpooler.TransactionPooler {
		fmt.Println("use a direct URL for LISTEN and migrations")
	}
	// Output:
	// reaches: direct
}
