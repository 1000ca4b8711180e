package testenv

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Exec runs sql on pool, failing the test on an error.
func Exec(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	if _, err := pool.Exec(ctx, sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// Count runs sql, a query of one integer (a count), on pool and returns it, failing the
// test on an error.
func Count(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	var n int
	if err := pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// Strings runs sql, a query of one text column, on pool and returns its values, failing
// the test on an error.
func Strings(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	rows, err := pool.Query(ctx, sql, args...)
	if err == nil {
		var out []string
		if out, err = pgx.CollectRows(rows, pgx.RowTo[string]); err == nil {
			return out
		}
	}
	t.Fatalf("%s: %v", sql, err)
	return nil
}
