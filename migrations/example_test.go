package migrations_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/migrations"
)

// Up applies the core set to the schema db's connections use (their search_path), and
// only what is pending: a second run applies nothing.
func ExampleUp() {
	ctx := context.Background()
	pool, cleanup := testenv.ExamplePostgres(false) // an empty schema of its own
	defer cleanup()
	db := stdlib.OpenDBFromPool(pool) // goose takes a *sql.DB
	defer db.Close()

	applied, err := migrations.Up(ctx, db)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("first run applied migrations:", len(applied) > 0)

	var ledger, example bool
	db.QueryRowContext(ctx, `SELECT to_regclass('processed_jobs') IS NOT NULL, to_regclass('wallet_entries') IS NOT NULL`).
		Scan(&ledger, &example)
	fmt.Printf("processed_jobs: %t, wallet_entries (example set): %t\n", ledger, example)

	applied, err = migrations.Up(ctx, db)
	fmt.Println("second run applied:", len(applied), err)
	// Output:
	// first run applied migrations: true
	// processed_jobs: true, wallet_entries (example set): false
	// second run applied: 0 <nil>
}
