package migrations_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/migrations"
)

// ledgerRow is an INSERT into processed_jobs of one row, given by the columns its rules
// are about; the others take their defaults.
type ledgerRow struct {
	name string
	sql  string
}

const insertRow = `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, generation, payload_sha256, attempts, locked_until, completed_at) `

// goodRows are one row of each status, each meeting every rule.
var goodRows = []ledgerRow{
	{"in_progress", insertRow + `VALUES ('good:1', 'wallet:debit', 'in_progress', 1, gen_random_uuid(), 0, sha256(''), 1, now(), NULL)`},
	{"in_progress without fingerprint", insertRow + `VALUES ('good:2', 'wallet:debit', 'in_progress', 2, gen_random_uuid(), 0, NULL, 0, now(), NULL)`},
	{"completed", insertRow + `VALUES ('good:3', 'wallet:debit', 'completed', 3, NULL, 2, sha256(''), 1, NULL, now())`},
	{"failed", insertRow + `VALUES ('good:4', 'wallet:debit', 'failed', 4, gen_random_uuid(), 0, sha256(''), 5, now(), now())`},
	{"needs_attention", insertRow + `VALUES ('good:5', 'wallet:debit', 'needs_attention', 5, NULL, 0, sha256(''), 3, NULL, NULL)`},
	{"task type of 255 bytes", insertRow + `VALUES ('good:6', repeat('t', 255), 'completed', 6, NULL, 0, NULL, 1, NULL, now())`},
}

// badRows each break one rule of processed_jobs (other than the key's), with the
// constraint that refused it before 00070.
var badRows = []struct {
	ledgerRow
	before string
}{
	{ledgerRow{"empty task type", insertRow + `VALUES ('bad:1', '', 'completed', 1, NULL, 0, NULL, 1, NULL, now())`}, "processed_jobs_task_type_check"},
	{ledgerRow{"task type of 256 bytes", insertRow + `VALUES ('bad:2', repeat('t', 256), 'completed', 1, NULL, 0, NULL, 1, NULL, now())`}, "processed_jobs_task_type_check"},
	{ledgerRow{"unknown status", insertRow + `VALUES ('bad:3', 'wallet:debit', 'done', 1, NULL, 0, NULL, 1, NULL, NULL)`}, "processed_jobs_status_check"},
	{ledgerRow{"fence 0", insertRow + `VALUES ('bad:4', 'wallet:debit', 'completed', 0, NULL, 0, NULL, 1, NULL, now())`}, "processed_jobs_fence_check"},
	{ledgerRow{"negative generation", insertRow + `VALUES ('bad:5', 'wallet:debit', 'completed', 1, NULL, -1, NULL, 1, NULL, now())`}, "processed_jobs_generation_check"},
	{ledgerRow{"negative attempts", insertRow + `VALUES ('bad:6', 'wallet:debit', 'completed', 1, NULL, 0, NULL, -1, NULL, now())`}, "processed_jobs_attempts_check"},
	{ledgerRow{"fingerprint of 31 bytes", insertRow + `VALUES ('bad:7', 'wallet:debit', 'completed', 1, NULL, 0, substring(sha256('') from 2), 1, NULL, now())`}, "processed_jobs_payload_sha256_check"},
	{ledgerRow{"in progress without owner", insertRow + `VALUES ('bad:8', 'wallet:debit', 'in_progress', 1, NULL, 0, NULL, 1, now(), NULL)`}, "processed_jobs_lease_check"},
	{ledgerRow{"in progress without lease end", insertRow + `VALUES ('bad:9', 'wallet:debit', 'in_progress', 1, gen_random_uuid(), 0, NULL, 1, NULL, NULL)`}, "processed_jobs_lease_check"},
	{ledgerRow{"in progress with completion time", insertRow + `VALUES ('bad:10', 'wallet:debit', 'in_progress', 1, gen_random_uuid(), 0, NULL, 1, now(), now())`}, "processed_jobs_completed_at_check"},
	{ledgerRow{"needs attention with completion time", insertRow + `VALUES ('bad:11', 'wallet:debit', 'needs_attention', 1, NULL, 0, NULL, 1, NULL, now())`}, "processed_jobs_completed_at_check"},
	{ledgerRow{"completed without completion time", insertRow + `VALUES ('bad:12', 'wallet:debit', 'completed', 1, NULL, 0, NULL, 1, NULL, NULL)`}, "processed_jobs_completed_at_check"},
	{ledgerRow{"failed without completion time", insertRow + `VALUES ('bad:13', 'wallet:debit', 'failed', 1, NULL, 0, NULL, 1, NULL, NULL)`}, "processed_jobs_completed_at_check"},
}

// TestRowCheckKeepsEveryRule migrates a ledger to the version before 00070 and fills it,
// checks which constraint refuses each broken row there, then applies the rest: the rows
// are kept, processed_jobs has three CHECKs left (the key's two, by their names, and
// processed_jobs_row_check, valid), and the same rows are refused by
// processed_jobs_row_check, the good ones accepted.
func TestRowCheckKeepsEveryRule(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pool, p := migratedTo(ctx, t, 61)

	// A populated ledger: rows of every status, with and without fingerprints.
	testenv.Exec(t, pool, `
		INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, generation, payload_sha256, attempts, locked_until, completed_at)
		SELECT 'old:' || i, 'wallet:debit', s.status, nextval('processed_jobs_fence_seq'),
		       CASE WHEN s.status = 'in_progress' THEN gen_random_uuid() END, i % 3,
		       CASE WHEN i % 2 = 0 THEN sha256(i::text::bytea) END, i % 5,
		       CASE WHEN s.status = 'in_progress' THEN now() + interval '1 minute' END,
		       CASE WHEN s.status IN ('completed', 'failed') THEN now() END
		FROM generate_series(1, 2000) i
		JOIN (VALUES (0, 'in_progress'), (1, 'completed'), (2, 'failed'), (3, 'needs_attention')) s(n, status) ON s.n = i % 4`)

	check := func(t *testing.T, constraint func(before string) string) {
		t.Helper()
		for _, r := range badRows {
			_, err := pool.Exec(ctx, r.sql)
			var pe *pgconn.PgError
			if want := constraint(r.before); !errors.As(err, &pe) || pe.Code != "23514" || pe.ConstraintName != want {
				t.Errorf("%s: %v; want a check violation of %s", r.name, err, want)
			}
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		for _, r := range goodRows {
			if _, err := tx.Exec(ctx, r.sql); err != nil {
				t.Errorf("%s: %v", r.name, err)
			}
		}
	}
	t.Run("before", func(t *testing.T) {
		check(t, func(before string) string { return before })
	})

	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if n := testenv.Count(t, pool, `SELECT count(*) FROM processed_jobs WHERE idempotency_key LIKE 'old:%'`); n != 2000 {
		t.Fatalf("%d of the 2000 rows are left", n)
	}
	got := testenv.Strings(t, pool, `
		SELECT conname || CASE WHEN convalidated THEN '' ELSE ' NOT VALID' END FROM pg_constraint
		WHERE conrelid = 'processed_jobs'::regclass AND contype = 'c' ORDER BY conname`)
	want := []string{"processed_jobs_key_check", "processed_jobs_key_no_hash_check NOT VALID", "processed_jobs_row_check"}
	if !slices.Equal(got, want) {
		t.Fatalf("processed_jobs' CHECKs are %q, want %q", got, want)
	}

	t.Run("after", func(t *testing.T) {
		check(t, func(string) string { return "processed_jobs_row_check" })
	})
}

// migratedTo returns a pool on an empty schema of its own, migrated up to version, and
// the provider that goes on from there.
func migratedTo(ctx context.Context, t *testing.T, version int64) (*pgxpool.Pool, *goose.Provider) {
	t.Helper()
	pool := testenv.Pool(t, testenv.EmptyPostgresURL(t))
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { db.Close() })
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, version); err != nil {
		t.Fatal(err)
	}
	return pool, p
}
