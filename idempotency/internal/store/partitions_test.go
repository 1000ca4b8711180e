package store_test

import (
	"regexp"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/internal/testenv"
)

// The events insert's cap counts a key's events in the partitions of its batch's days
// only: planned with its arguments (sent unnamed, as the ledger sends it), the plan reads
// no other day of processed_job_events, however many the table has. Here it has 38, as
// under a 30-day retention, and a batch of today's events reads today's one.
func TestEventsCapReadsTheBatchDaysOnly(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ctx := testenv.Context(t, time.Minute)
	now := time.Now()
	if _, err := store.AddEventDays(ctx, pool, now, 38); err != nil {
		t.Fatal(err)
	}
	days, err := store.EventDays(ctx, pool)
	if err != nil || len(days) < 38 {
		t.Fatalf("partitions: %d, %v; want at least 38", len(days), err)
	}
	es := []store.EventParams{{Key: "k", Kind: "duplicate", At: now}, {Key: "k", Kind: "duplicate", At: now.Add(-time.Second)}}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		p := plan(ctx, t, tx, `EXPLAIN (COSTS OFF) `+store.InsertEvents.SQL, store.EventArgs(es)...)
		read := regexp.MustCompile(`on processed_job_events_(legacy|p\d{8}) `).FindAllString(p, -1)
		slices.Sort(read)
		read = slices.Compact(read)
		if len(read) != 1 {
			t.Errorf("the cap's count reads %q, want today's partition only:\n%s", read, p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
