package testenv

import (
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemq/idemq/migrations"
)

const postgresHint = "start one with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` " +
	"(or `docker compose up -d postgres`), or point TEST_DATABASE_URL at one"

// PostgresURL creates a fresh schema on the shared test database, applies the migrations
// to it and returns a URL whose connections use only that schema (search_path is set per
// connection). The schema is dropped when the test ends. The database is read from
// TEST_DATABASE_URL, then DATABASE_URL, then DefaultDatabaseURL.
func PostgresURL(t testing.TB) string {
	t.Helper()
	return schemaURL(t, firstEnv(DefaultDatabaseURL, "TEST_DATABASE_URL", "DATABASE_URL"), true)
}

// EmptyPostgresURL is PostgresURL without the migrations: the schema is empty.
func EmptyPostgresURL(t testing.TB) string {
	t.Helper()
	return schemaURL(t, firstEnv(DefaultDatabaseURL, "TEST_DATABASE_URL", "DATABASE_URL"), false)
}

// Postgres returns a pool on a fresh migrated schema of its own (see PostgresURL), closed
// and dropped when the test ends.
func Postgres(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return Pool(t, PostgresURL(t))
}

// Pool opens a pool on dsn and closes it when the test ends.
func Pool(t testing.TB, dsn string) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		fatalf(t, "open pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// schemaURL makes a schema (migrated if migrate is set) on the database at base and
// returns base with search_path pointing at it.
func schemaURL(t testing.TB, base string, migrate bool) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	admin, err := pgx.Connect(ctx, base)
	if err != nil {
		fatalf(t, "Postgres at %s does not answer: %v; %s", redact(base), err, postgresHint)
	}
	defer admin.Close(context.Background())

	schema := randomName("t_" + truncate(sanitize(t.Name()), 30) + "_")
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		fatalf(t, "create schema: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, base)
		if err != nil {
			t.Errorf("testenv: drop schema %s: %v", schema, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("testenv: drop schema %s: %v", schema, err)
		}
	})

	dsn, err := withSearchPath(base, schema)
	if err != nil {
		fatalf(t, "%v", err)
	}
	if !migrate {
		return dsn
	}
	if err := Migrate(ctx, dsn); err != nil {
		fatalf(t, "migrate schema %s: %v", schema, err)
	}
	return dsn
}

// Migrate applies idemq's migrations to the database at dsn.
func Migrate(ctx context.Context, dsn string) error {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return err
	}
	db := stdlib.OpenDB(*cfg)
	defer db.Close()
	_, err = migrations.Up(ctx, db)
	return err
}

// OpenDB opens a database/sql handle on dsn, closed when the test ends.
func OpenDB(t testing.TB, dsn string) *sql.DB {
	t.Helper()
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		fatalf(t, "parse %s: %v", redact(dsn), err)
	}
	db := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { db.Close() })
	return db
}

// withSearchPath adds search_path=schema to a postgres:// URL (pgx sends unknown URL
// parameters as run-time parameters).
func withSearchPath(base, schema string) (string, error) {
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return "", fmt.Errorf("testenv: the test database must be a postgres:// URL, got %s", redact(base))
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String(), nil
}

func redact(dsn string) string {
	u, err := url.Parse(dsn)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}
