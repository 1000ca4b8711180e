package migrations_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/fstest"
	"time"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/migrations"
)

// coreTables and exampleTables are the tables each set creates.
var (
	coreTables    = []string{"processed_jobs", "job_intents", "api_idempotency_keys", "redis_epochs", "processed_job_steps", "schedule_entries", "processed_job_events", "idemq_processes"}
	exampleTables = []string{"fakepay_requests", "fakepay_charges", "wallet_entries"}
)

// appFiles are an application's own goose migrations: its versions 1 and 2, recorded in
// goose's default table.
var appFiles = fstest.MapFS{
	"00001_customers.sql": {Data: []byte(`-- +goose Up
CREATE TABLE app_customers (id bigint PRIMARY KEY);
-- +goose Down
DROP TABLE app_customers;
`)},
	"00002_orders.sql": {Data: []byte(`-- +goose Up
CREATE TABLE app_orders (id bigint PRIMARY KEY, customer_id bigint NOT NULL REFERENCES app_customers);
-- +goose Down
DROP TABLE app_orders;
`)},
}

// appProvider is the application's goose provider, as an application sets one up: goose's
// default version table and goose's default session lock (probed every second).
func appProvider(t *testing.T, db *sql.DB, fsys fstest.MapFS, opts ...goose.ProviderOption) *goose.Provider {
	t.Helper()
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockTimeout(1, 120))
	if err != nil {
		t.Fatal(err)
	}
	opts = append(opts, goose.WithSessionLocker(locker), goose.WithDisableGlobalRegistry(true))
	p, err := goose.NewProvider(goose.DialectPostgres, db, fsys, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// missingTables returns those of names that are not tables of db's current schema.
func missingTables(ctx context.Context, t *testing.T, db *sql.DB, names ...string) []string {
	t.Helper()
	var missing []string
	for _, n := range names {
		var ok bool
		if err := db.QueryRowContext(ctx, `SELECT to_regclass(quote_ident(current_schema()) || '.' || $1) IS NOT NULL`, n).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		if !ok {
			missing = append(missing, n)
		}
	}
	return missing
}

// versions returns the versions recorded in table (0 left out), in order, with repeats.
func versions(ctx context.Context, t *testing.T, db *sql.DB, table string) []int64 {
	t.Helper()
	rows, err := db.QueryContext(ctx, `SELECT version_id FROM `+table+` WHERE version_id > 0 ORDER BY version_id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var v int64
		if err := rows.Scan(&v); err != nil {
			t.Fatal(err)
		}
		out = append(out, v)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// sourceVersions are the versions of p's files.
func sourceVersions(p *goose.Provider) []int64 {
	var out []int64
	for _, s := range p.ListSources() {
		out = append(out, s.Version)
	}
	return out
}

// TestBesideApplicationGooseMigrations migrates one schema with an application's own goose
// migrations (versions 1 and 2, goose's default table and lock) and with idemq's, in
// both orders: every table of both is there, each side's versions are recorded once in
// its own table, and neither has anything pending.
func TestBesideApplicationGooseMigrations(t *testing.T) {
	t.Parallel()
	for _, idemqFirst := range []bool{true, false} {
		name := map[bool]string{true: "idemq first", false: "application first"}[idemqFirst]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := testenv.Context(t, 2*time.Minute)
			db := testenv.OpenDB(t, testenv.EmptyPostgresURL(t))
			app := appProvider(t, db, appFiles)
			steps := []func() error{
				func() error { _, err := app.Up(ctx); return err },
				func() error { _, err := migrations.Up(ctx, db); return err },
			}
			if idemqFirst {
				slices.Reverse(steps)
			}
			for _, step := range steps {
				if err := step(); err != nil {
					t.Fatal(err)
				}
			}

			if m := missingTables(ctx, t, db, append([]string{"app_customers", "app_orders"}, coreTables...)...); len(m) > 0 {
				t.Fatalf("tables missing: %v", m)
			}
			if got := versions(ctx, t, db, "goose_db_version"); !slices.Equal(got, []int64{1, 2}) {
				t.Errorf("goose_db_version holds %v, want the application's [1 2]", got)
			}
			idemq, err := migrations.NewProvider(ctx, db)
			if err != nil {
				t.Fatal(err)
			}
			if got, want := versions(ctx, t, db, migrations.VersionTable), sourceVersions(idemq); !slices.Equal(got, want) {
				t.Errorf("%s holds %v, want %v", migrations.VersionTable, got, want)
			}
			for _, p := range []*goose.Provider{app, idemq} {
				if pending, err := p.HasPending(ctx); err != nil || pending {
					t.Errorf("pending migrations left: %v, %v", pending, err)
				}
			}
		})
	}
}

// TestUpFromInsideAnApplicationMigration runs migrations.Up from an application's own Go
// migration, registered with the application's goose provider, which holds goose's
// default lock while it runs, in the public schema of a database of its own; the
// application's next migration references processed_jobs. Up must not wait for the lock
// its caller holds.
func TestUpFromInsideAnApplicationMigration(t *testing.T) {
	t.Parallel()
	// Far less than the 5 minutes a migrator waits for the lock, far more than the
	// migrations take.
	ctx := testenv.Context(t, 90*time.Second)
	db := testenv.OpenDB(t, testenv.EmptyDatabaseURL(t))
	var schema string
	if err := db.QueryRowContext(ctx, `SELECT current_schema()`).Scan(&schema); err != nil || schema != "public" {
		t.Fatalf("current schema %q (%v), want public", schema, err)
	}
	fsys := fstest.MapFS{"00002_jobs.sql": {Data: []byte(`-- +goose Up
CREATE TABLE app_jobs (key text PRIMARY KEY REFERENCES processed_jobs (idempotency_key));
-- +goose Down
DROP TABLE app_jobs;
`)}}
	idemqUp := goose.NewGoMigration(1, &goose.GoFunc{RunDB: func(ctx context.Context, db *sql.DB) error {
		_, err := migrations.Up(ctx, db)
		return err
	}}, nil)
	app := appProvider(t, db, fsys, goose.WithGoMigrations(idemqUp))
	if _, err := app.Up(ctx); err != nil {
		t.Fatalf("the application's migrations: %v", err)
	}
	if m := missingTables(ctx, t, db, append([]string{"app_jobs"}, coreTables...)...); len(m) > 0 {
		t.Fatalf("tables missing: %v", m)
	}
}

// TestUpCreatesNoExampleTables: Up creates the library's tables only, and writes neither
// goose's default table nor the example's; UpExample creates the example's.
func TestUpCreatesNoExampleTables(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	db := testenv.OpenDB(t, testenv.EmptyPostgresURL(t))
	if _, err := migrations.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	var tables []string
	// Tables, not their partitions (processed_job_events' days).
	rows, err := db.QueryContext(ctx, `SELECT relname FROM pg_class
		WHERE relnamespace = current_schema()::regnamespace AND relkind IN ('r', 'p') AND NOT relispartition ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			t.Fatal(err)
		}
		tables = append(tables, n)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	want := append(slices.Clone(coreTables), migrations.VersionTable)
	slices.Sort(want)
	if !slices.Equal(tables, want) {
		t.Fatalf("Up made the tables %v, want %v", tables, want)
	}

	res, err := migrations.UpExample(ctx, db)
	if err != nil || len(res) == 0 {
		t.Fatalf("UpExample: %d applied, %v", len(res), err)
	}
	if m := missingTables(ctx, t, db, append(exampleTables, migrations.ExampleVersionTable)...); len(m) > 0 {
		t.Fatalf("UpExample did not make %v", m)
	}
}

// TestUpgradeFromGooseDefaultTable migrates a schema as an older idemq did (both sets'
// files in one goose run, recorded in goose_db_version), adds an application's later
// version there and a ledger row, then runs the current migrations twice at once, as
// two `idemq migrate` would: nothing an older idemq applied runs again, each version is
// recorded once in idemq's tables, goose_db_version is left exactly as it was, and the row
// is still there.
func TestUpgradeFromGooseDefaultTable(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 2*time.Minute)
	db := testenv.OpenDB(t, testenv.EmptyPostgresURL(t))
	old, err := goose.NewProvider(goose.DialectPostgres, db, migrations.LegacyFiles(), goose.WithDisableGlobalRegistry(true))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := old.Up(ctx); err != nil {
		t.Fatal(err)
	}
	later := fstest.MapFS{"00100_accounts.sql": {Data: []byte("-- +goose Up\nCREATE TABLE app_accounts (id bigint PRIMARY KEY);\n")}}
	if _, err := appProvider(t, db, later).Up(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, attempts, completed_at)
		VALUES ('debit:before-upgrade', 'wallet:debit', 'completed', nextval('processed_jobs_fence_seq'), 1, now())`); err != nil {
		t.Fatal(err)
	}
	gooseRows := func() string {
		var s string
		if err := db.QueryRowContext(ctx, `SELECT string_agg(format('%s %s %s %s', id, version_id, is_applied, tstamp), '; ' ORDER BY id) FROM goose_db_version`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := gooseRows()

	coreLegacy, exampleLegacy := migrations.LegacyVersions()
	legacy := append(slices.Clone(coreLegacy), exampleLegacy...)
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, up := range []func(context.Context, *sql.DB) ([]*goose.MigrationResult, error){migrations.Up, migrations.UpExample} {
				res, err := up(ctx, db)
				if err != nil {
					errs[i] = err
					return
				}
				for _, r := range res {
					if slices.Contains(legacy, r.Source.Version) {
						errs[i] = fmt.Errorf("%s ran again", r.Source.Path)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("migrator %d: %v", i, err)
		}
	}

	for _, s := range []struct {
		table       string
		newProvider func(context.Context, *sql.DB) (*goose.Provider, error)
	}{
		{migrations.VersionTable, migrations.NewProvider},
		{migrations.ExampleVersionTable, migrations.NewExampleProvider},
	} {
		p, err := s.newProvider(ctx, db)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := versions(ctx, t, db, s.table), sourceVersions(p); !slices.Equal(got, want) {
			t.Errorf("%s holds %v, want %v once each", s.table, got, want)
		}
	}
	if after := gooseRows(); after != before {
		t.Errorf("goose_db_version changed:\nbefore %s\nafter  %s", before, after)
	}
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM processed_jobs WHERE idempotency_key = 'debit:before-upgrade'`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("the ledger row before the upgrade: %d rows, %v", n, err)
	}
}

// TestCarryOverRefusesObjectsOutOfOrder: an older idemq run after an application's goose
// migrations skipped its own version 1 (the application's was recorded under that
// number) and stopped at version 50, leaving job_intents and api_idempotency_keys without
// processed_jobs. The current migrations refuse to guess, naming what is there and what
// is missing, and record nothing.
func TestCarryOverRefusesObjectsOutOfOrder(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	db := testenv.OpenDB(t, testenv.EmptyPostgresURL(t))
	if _, err := appProvider(t, db, appFiles).Up(ctx); err != nil {
		t.Fatal(err)
	}
	old, err := goose.NewProvider(goose.DialectPostgres, db, migrations.LegacyFiles(), goose.WithDisableGlobalRegistry(true))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := old.Up(ctx); err == nil || !strings.Contains(err.Error(), "processed_jobs") {
		t.Fatalf("the older idemq after the application: %v, want it to stop at processed_jobs", err)
	}

	_, err = migrations.Up(ctx, db)
	t.Logf("refusal: %v", err)
	for _, want := range []string{"table job_intents (version 20)", "table api_idempotency_keys (version 40)", "not table processed_jobs (version 1)"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("Up: %v, want a refusal naming %q", err, want)
		}
	}
	if m := missingTables(ctx, t, db, migrations.VersionTable); len(m) == 0 {
		if got := versions(ctx, t, db, migrations.VersionTable); len(got) != 0 {
			t.Fatalf("%s holds %v after the refusal", migrations.VersionTable, got)
		}
	}
}

// UpPool applies the core set through a pgx pool, as Up does through a *sql.DB, and
// leaves the pool open.
func TestUpPool(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	pool := testenv.Pool(t, testenv.EmptyPostgresURL(t))
	applied, err := migrations.UpPool(ctx, pool)
	if err != nil || len(applied) == 0 {
		t.Fatalf("UpPool on an empty schema: %d applied, %v", len(applied), err)
	}
	if again, err := migrations.UpPool(ctx, pool); err != nil || len(again) != 0 {
		t.Fatalf("UpPool on a current schema: %d applied, %v; want none", len(again), err)
	}
	for _, table := range coreTables {
		if n := testenv.Count(t, pool, "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename = $1", table); n != 1 {
			t.Errorf("table %s: %d, want 1", table, n)
		}
	}
	if n := testenv.Count(t, pool, "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename = 'wallet_entries'"); n != 0 {
		t.Errorf("UpPool created the example's tables")
	}
	if err := pool.Ping(ctx); err != nil {
		t.Fatalf("the pool after UpPool: %v", err)
	}
}
