package migrations_test

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/migrations"
)

// Migration 00114 turns a processed_job_events that holds events into a table partitioned
// by day, in place: the events stay, readable under the same name, the ids go on from
// where they were, and the old table becomes the first partition without a scan under
// its ACCESS EXCLUSIVE lock (Postgres says, at DEBUG1, that its validated bound implies
// the partition's range). Inserts as the previous release writes them, with at given and
// without, land in the partitions.
func TestEventsPartitionedInPlace(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	dsn := testenv.EmptyPostgresURL(t)
	pool := testenv.Pool(t, dsn)

	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var notices []string
	cfg.RuntimeParams["client_min_messages"] = "debug1"
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		mu.Lock()
		defer mu.Unlock()
		notices = append(notices, n.Message)
	}
	db := stdlib.OpenDB(*cfg)
	defer db.Close()
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 113); err != nil {
		t.Fatal(err)
	}
	testenv.Exec(t, pool, `INSERT INTO processed_job_events (idempotency_key, generation, kind, at)
		SELECT 'k' || i, 0, 'duplicate', now() - i * interval '1 hour' FROM generate_series(1, 1000) i`)
	before := testenv.Count(t, pool, `SELECT max(id) FROM processed_job_events`)

	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	implied := false
	for _, n := range notices {
		implied = implied || strings.Contains(n, `partition constraint for table "processed_job_events_legacy" is implied by existing constraints`)
	}
	mu.Unlock()
	if !implied {
		t.Errorf("the legacy table was not attached on its validated bound (a scan under ACCESS EXCLUSIVE); notices: %q", notices)
	}
	if kind := testenv.Strings(t, pool, `SELECT relkind::text FROM pg_class WHERE oid = 'processed_job_events'::regclass`); kind[0] != "p" {
		t.Fatalf("processed_job_events is of kind %s, want a partitioned table", kind[0])
	}
	if n := testenv.Count(t, pool, `SELECT count(*) FROM processed_job_events_legacy`); n != 1000 {
		t.Fatalf("the legacy partition holds %d events, want the 1000 written before", n)
	}
	// 8 partitions: the legacy one and a week of days after it.
	if n := testenv.Count(t, pool, `SELECT count(*) FROM pg_inherits WHERE inhparent = 'processed_job_events'::regclass`); n != 8 {
		t.Fatalf("%d partitions, want 8", n)
	}
	// The previous release's insert (no at: now()) and one dated three days ahead.
	testenv.Exec(t, pool, `INSERT INTO processed_job_events (idempotency_key, generation, kind) VALUES ('new', 0, 'rerun')`)
	testenv.Exec(t, pool, `INSERT INTO processed_job_events (idempotency_key, generation, kind, at) VALUES ('ahead', 0, 'busy', now() + interval '3 days')`)
	if got := testenv.Count(t, pool, `SELECT min(id) FROM processed_job_events WHERE idempotency_key IN ('new', 'ahead')`); got <= before {
		t.Errorf("a new event's id %d does not follow the last one before, %d", got, before)
	}
	where := testenv.Strings(t, pool, `SELECT tableoid::regclass::text FROM processed_job_events WHERE idempotency_key = 'ahead'`)
	if len(where) != 1 || !strings.HasPrefix(where[0], "processed_job_events_p") {
		t.Errorf("the event three days ahead is in %q, want a day's partition", where)
	}
	if n := testenv.Count(t, pool, `SELECT count(*) FROM processed_job_events WHERE idempotency_key = 'k7'`); n != 1 {
		t.Errorf("an event written before reads %d times by its key, want 1", n)
	}
}
