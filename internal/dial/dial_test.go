package dial_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/internal/dial"
	"github.com/idemq/idemq/internal/localserver"
	"github.com/idemq/idemq/internal/testenv"
)

func TestParseErrorsHideThePassword(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct {
		url     string
		cluster bool
	}{
		{"redis://:S3cretPW@[::1", false},
		{"redis://u:S3cretPW@host:notaport/0", false},
		{"redis://u:S3cretPW@host:26379/0?master_name=m&bogus=1", false},
		{"redis://u:S3cretPW@[::1?addr=h2:7001", true},
	} {
		_, err := dial.Redis(ctx, tc.url, tc.cluster)
		if err == nil || !strings.HasPrefix(err.Error(), "REDIS_URL") || strings.Contains(err.Error(), "S3cretPW") {
			t.Errorf("dial.Redis(%q, cluster %v) = %v, want an error naming REDIS_URL without the password", tc.url, tc.cluster, err)
		}
		if _, err := dial.AsynqRedis(tc.url, tc.cluster); err == nil || strings.Contains(err.Error(), "S3cretPW") {
			t.Errorf("dial.AsynqRedis(%q, cluster %v) = %v, want an error without the password", tc.url, tc.cluster, err)
		}
	}
	for _, u := range []string{"postgres://u:S3cretPW@[::1/db", "postgres://u:S3cretPW@h/db?pool_max_conns=x"} {
		_, err := dial.Postgres(ctx, u, 0)
		if err == nil || !strings.HasPrefix(err.Error(), "DATABASE_URL: ") || strings.Contains(err.Error(), "S3cretPW") {
			t.Errorf("dial.Postgres(%q) = %v, want an error naming DATABASE_URL without the password", u, err)
		}
	}
}

// A pool_max_conns in the DSN wins over the size the caller computed; without it the
// caller's size holds.
func TestExplicitPoolSizeWins(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 30*time.Second)
	base := testenv.PostgresURL(t)
	for _, tc := range []struct {
		dsn  string
		want int32
	}{{base, 7}, {base + "&pool_max_conns=3", 3}} {
		pool, err := dial.Postgres(ctx, tc.dsn, 7)
		if err != nil {
			t.Fatal(err)
		}
		if got := pool.Config().MaxConns; got != tc.want {
			t.Errorf("pool size %d, want %d (DSN sets it: %t)", got, tc.want, tc.want == 3)
		}
		pool.Close()
	}
}

// Behind a transaction-mode pooler, pgx's named prepared statements fail with 42P05 or
// 26000: the error then says what to put in DATABASE_URL; any other error is unchanged.
func TestPoolerHint(t *testing.T) {
	t.Parallel()
	for _, code := range []string{"42P05", "26000"} {
		err := fmt.Errorf("check schema version: %w", &pgconn.PgError{Code: code, Message: "prepared statement"})
		got := dial.PoolerHint(err)
		if !strings.Contains(got.Error(), "default_query_exec_mode=cache_describe") || !errors.Is(got, err) {
			t.Errorf("%s: %v, want the pooler hint wrapping the error", code, got)
		}
	}
	other := &pgconn.PgError{Code: "42P01", Message: "relation does not exist"}
	if got := dial.PoolerHint(other); got != error(other) {
		t.Errorf("42P01: %v, want it unchanged", got)
	}
}

// OpenDatabase on a transaction-mode PgBouncer: the pool sends unnamed statements unless
// the URL chose a mode; with a direct URL, sessions and heartbeats go to Postgres itself;
// without one there is no session; a direct URL that is itself the pooler is refused; on
// Postgres itself nothing changes.
func TestOpenDatabaseBehindAPooler(t *testing.T) {
	testenv.NeedBinary(t, "pgbouncer", "apt-get install -y pgbouncer")
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	server := testenv.ServerURL()
	pgb, err := localserver.StartPgBouncer(server, "transaction", 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pgb.Close() })
	log := slog.New(slog.DiscardHandler)
	serverPort := func(cfg *pgx.ConnConfig) uint16 { return cfg.Port }
	direct, err := pgx.ParseConfig(server)
	if err != nil {
		t.Fatal(err)
	}

	db, err := dial.OpenDatabase(ctx, pgb.URL, server, 4, log)
	if err != nil {
		t.Fatal(err)
	}
	if !db.Pooled || db.Pool.Config().ConnConfig.DefaultQueryExecMode != pgx.QueryExecModeCacheDescribe {
		t.Errorf("pooled %t, exec mode %v; want pooled, cache_describe", db.Pooled, db.Pool.Config().ConnConfig.DefaultQueryExecMode)
	}
	if db.Session == nil || serverPort(db.Session) != direct.Port || db.Heartbeats == nil || serverPort(db.Heartbeats.Config().ConnConfig) != direct.Port {
		t.Errorf("session %v, heartbeats %v: want both on Postgres itself (port %d)", db.Session, db.Heartbeats, direct.Port)
	}
	if err := db.Heartbeats.Ping(ctx); err != nil {
		t.Error(err)
	}
	db.Close()

	db, err = dial.OpenDatabase(ctx, pgb.URL+"&default_query_exec_mode=exec", "", 4, log)
	if err != nil {
		t.Fatal(err)
	}
	if db.Session != nil || db.Heartbeats != nil || db.Pool.Config().ConnConfig.DefaultQueryExecMode != pgx.QueryExecModeExec {
		t.Errorf("without a direct URL: session %v, heartbeats %v, exec mode %v; want none, none, the URL's exec", db.Session, db.Heartbeats,
			db.Pool.Config().ConnConfig.DefaultQueryExecMode)
	}
	db.Close()

	if _, err := dial.OpenDatabase(ctx, pgb.URL, pgb.URL, 4, log); !errors.Is(err, dial.ErrTransactionPooler) ||
		!strings.Contains(err.Error(), "IDEMQ_DIRECT_DATABASE_URL") {
		t.Errorf("a direct URL on the pooler: %v, want a refusal naming IDEMQ_DIRECT_DATABASE_URL", err)
	}

	db, err = dial.OpenDatabase(ctx, server, "", 4, log)
	if err != nil {
		t.Fatal(err)
	}
	if db.Pooled || db.Session == nil || db.Heartbeats != nil || db.Pool.Config().ConnConfig.DefaultQueryExecMode != pgx.QueryExecModeCacheStatement {
		t.Errorf("on Postgres: pooled %t, session %v, heartbeats %v, exec mode %v; want not pooled, the pool's, none (the ledger's own), cache_statement",
			db.Pooled, db.Session, db.Heartbeats, db.Pool.Config().ConnConfig.DefaultQueryExecMode)
	}
	db.Close()
}
