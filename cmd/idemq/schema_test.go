package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/migrations"
)

// schemaSnapshot is every table of the pool's current schema with a digest of its rows,
// one line each.
func schemaSnapshot(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	ctx := testenv.Context(t, 30*time.Second)
	tables := testenv.Strings(t, pool, "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() ORDER BY tablename")
	var b strings.Builder
	for _, name := range tables {
		var n int64
		var digest *string
		q := fmt.Sprintf("SELECT count(*), md5(string_agg(t::text, ',' ORDER BY t::text)) FROM %s t", pgx.Identifier{name}.Sanitize())
		if err := pool.QueryRow(ctx, q).Scan(&n, &digest); err != nil {
			t.Fatalf("read %s: %v", name, err)
		}
		d := "-"
		if digest != nil {
			d = *digest
		}
		fmt.Fprintf(&b, "%s %d %s\n", name, n, d)
	}
	return b.String()
}

// A schema that only migrations.Up made (a library user's) serves the operator's
// commands; the commands that run the example refuse it, naming the example's migrations
// and the fix. Neither a refused start nor migrate --dry-run or --status writes anything,
// on an empty schema or on that one.
func TestCoreOnlySchemaServesOperatorCommands(t *testing.T) {
	t.Parallel()
	dsn := testenv.EmptyPostgresURL(t)
	pool := testenv.Pool(t, dsn)
	redisURL := testenv.RedisURL(t)
	env := []string{"DATABASE_URL=" + dsn, "REDIS_URL=" + redisURL, "IDEMQ_METRICS_ADDR=",
		fmt.Sprintf("IDEMQ_HTTP_ADDR=127.0.0.1:%d", testenv.FreePort(t)), fmt.Sprintf("IDEMQ_FAKEPAY_ADDR=127.0.0.1:%d", testenv.FreePort(t))}
	readOnly := func(stage string, args ...string) (stdout, stderr string, err error) {
		t.Helper()
		before := schemaSnapshot(t, pool)
		stdout, stderr, err = idemq(t, env, args...)
		if after := schemaSnapshot(t, pool); after != before {
			t.Errorf("%s: idemq %s changed the schema:\nbefore:\n%safter:\n%s", stage, strings.Join(args, " "), before, after)
		}
		return stdout, stderr, err
	}

	// An empty schema: every command that needs it refuses and names `idemq migrate`.
	for _, args := range [][]string{{"ledger", "list"}, {"schedule", "list"}, {"worker"}} {
		if _, stderr, err := readOnly("empty schema", args...); err == nil || !strings.Contains(stderr, "run `idemq migrate` first") {
			t.Errorf("idemq %s on an empty schema: %v\n%s", strings.Join(args, " "), err, stderr)
		}
	}
	for _, args := range [][]string{{"migrate", "--dry-run"}, {"migrate", "--status"}} {
		if out, stderr, err := readOnly("empty schema", args...); err != nil || !strings.Contains(out, "00001_processed_jobs.sql") {
			t.Errorf("idemq %s on an empty schema: %v\n%s%s", strings.Join(args, " "), err, out, stderr)
		}
	}

	// idemq's tables only, as a library user's application makes them.
	ctx := testenv.Context(t, time.Minute)
	if _, err := migrations.Up(ctx, testenv.OpenDB(t, dsn)); err != nil {
		t.Fatal(err)
	}
	if out, stderr, err := readOnly("core-only schema", "ledger", "list"); err != nil || !strings.Contains(out, "(no rows)") {
		t.Errorf("ledger list on a core-only schema: %v\n%s%s", err, out, stderr)
	}
	if out, stderr, err := readOnly("core-only schema", "schedule", "list"); err != nil {
		t.Errorf("schedule list on a core-only schema: %v\n%s%s", err, out, stderr)
	}
	out, stderr, err := readOnly("core-only schema", "migrate", "--status")
	if err != nil || !strings.Contains(out, "example/00010_fakepay.sql") || !lineHas(out, "00001_processed_jobs.sql", "applied") {
		t.Errorf("migrate --status on a core-only schema: %v\n%s%s", err, out, stderr)
	}
	out, stderr, err = readOnly("core-only schema", "migrate", "--dry-run")
	if err != nil || !strings.Contains(out, "would apply example/00010_fakepay.sql") || strings.Contains(out, "would apply 00001_") {
		t.Errorf("migrate --dry-run on a core-only schema: %v\n%s%s", err, out, stderr)
	}
	for _, args := range [][]string{
		{"worker"}, {"api"}, {"fakepay"},
		{"enqueue", "debit", "--account-id", "acct-1", "--amount-cents", "100", "--reference", "r-1"},
	} {
		_, stderr, err := readOnly("core-only schema", args...)
		for _, want := range []string{"idemq " + args[0] + " runs the example", "example/00010_fakepay.sql", "`idemq migrate`, which adds the example's tables"} {
			if err == nil || !strings.Contains(stderr, want) {
				t.Errorf("idemq %s on a core-only schema: %v, want a refusal naming %q:\n%s", args[0], err, want, stderr)
			}
		}
	}
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename IN ('wallet_entries', 'fakepay_requests')").Scan(&n); err != nil || n != 0 {
		t.Fatalf("the example's tables: %d, %v; want none", n, err)
	}
}

// lineHas reports whether the line of out that names what says want too.
func lineHas(out, what, want string) bool {
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, what) {
			return strings.Contains(line, want)
		}
	}
	return false
}
