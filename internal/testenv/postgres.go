package testenv

import (
	"context"
	"database/sql"
	"net/url"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemq/idemq/internal/localserver"
	"github.com/idemq/idemq/migrations"
)

const postgresHint = "start one with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` " +
	"(or `docker compose up -d postgres`), or point TEST_DATABASE_URL at one"

// PostgresURL creates a fresh schema on the shared test database, applies the migrations
// (the example's too: see Migrate) to it and returns a URL whose connections use only that schema (search_path is set per
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

// EmptyDatabaseURL creates a database of its own on the shared test server and returns
// its URL: unlike a schema, it has its own public schema and its own advisory locks (what
// goose's default lock and a migration of "public" take). It is dropped when the test
// ends.
func EmptyDatabaseURL(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	base := firstEnv(DefaultDatabaseURL, "TEST_DATABASE_URL", "DATABASE_URL")
	u, err := url.Parse(base)
	if err != nil {
		fatalf(t, "parse %s: %v", localserver.Redact(base), err)
	}
	name := randomName("t_" + truncate(sanitize(t.Name()), 30) + "_")
	conn, err := pgx.Connect(ctx, base)
	if err != nil {
		fatalf(t, "%v; %s", err, postgresHint)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		fatalf(t, "create database %s: %v", name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
		defer cancel()
		conn, err := pgx.Connect(ctx, base)
		if err == nil {
			defer conn.Close(context.WithoutCancel(ctx))
			_, err = conn.Exec(ctx, "DROP DATABASE "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
		}
		if err != nil {
			t.Errorf("testenv: drop database %s: %v", name, err)
		}
	})
	u.Path = "/" + name
	return u.String()
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
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		fatalf(t, "open pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// schemaURL makes a schema (migrated if migrate is set) on the database at base and
// returns its URL (search_path set to it); the schema is dropped when the test ends.
func schemaURL(t testing.TB, base string, migrate bool) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	schema, err := localserver.CreateSchema(ctx, base, randomName("t_"+truncate(sanitize(t.Name()), 30)+"_"), nil)
	if err != nil {
		fatalf(t, "%v; %s", err, postgresHint)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
		defer cancel()
		if err := schema.Drop(ctx); err != nil {
			t.Errorf("testenv: %v", err)
		}
	})
	if !migrate {
		return schema.URL
	}
	if err := Migrate(ctx, schema.URL); err != nil {
		fatalf(t, "migrate schema %s: %v", schema.Name, err)
	}
	return schema.URL
}

// Migrate applies idemq's migrations to the database at dsn, the example's too (the
// handlers' and fakepay's tables), as `idemq migrate` does.
func Migrate(ctx context.Context, dsn string) error {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return err
	}
	db := stdlib.OpenDB(*cfg)
	defer db.Close()
	if _, err := migrations.Up(ctx, db); err != nil {
		return err
	}
	_, err = migrations.UpExample(ctx, db)
	return err
}

// OpenDB opens a database/sql handle on dsn, closed when the test ends.
func OpenDB(t testing.TB, dsn string) *sql.DB {
	t.Helper()
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		fatalf(t, "parse %s: %v", localserver.Redact(dsn), err)
	}
	db := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { db.Close() })
	return db
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// ServerURL is the URL of the shared test server's database itself (no schema of its
// own): TEST_DATABASE_URL, then DATABASE_URL, then DefaultDatabaseURL. Only for what
// connects to the server without writing, such as a pooler in front of it.
func ServerURL() string {
	return firstEnv(DefaultDatabaseURL, "TEST_DATABASE_URL", "DATABASE_URL")
}
