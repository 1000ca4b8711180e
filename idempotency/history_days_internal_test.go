package idempotency

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/internal/testenv"
)

// The retention round drops keys' histories a day at a time: each partition whose range
// ended before the window, the legacy one included, goes whole with its events, the
// others stay with theirs, the days ahead are readied, and events written meanwhile
// (through the partitioned table, into a day that stays) are all kept. It runs here on
// clocks days ahead, which the partitions do not know from the real one.
func TestPurgeDropsHistoryByTheDay(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ctx := testenv.Context(t, time.Minute)
	var mu sync.Mutex
	dropped := map[string]int{}
	l := New(pool, &Config{ObservePurge: func(table string, rows int64, took time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		dropped[table]++
	}})
	defer l.Close()

	days := func() []string {
		return testenv.Strings(t, pool, `SELECT relname FROM (`+store.EventDaysSQL+`) d ORDER BY upper`)
	}
	start := days()
	if len(start) != 8 || start[0] != "processed_job_events_legacy" {
		t.Fatalf("partitions after the migration: %q; want the legacy one and 7 days", start)
	}
	// bound is where the legacy partition ends and the first day begins.
	var bound time.Time
	if err := pool.QueryRow(ctx, `SELECT min(upper) FROM (`+store.EventDaysSQL+`) d`).Scan(&bound); err != nil {
		t.Fatal(err)
	}
	testenv.Exec(t, pool, `INSERT INTO processed_job_events (idempotency_key, generation, kind, at) VALUES
		('legacy', 0, 'duplicate', now() - interval '1 day'),
		('first-day', 0, 'duplicate', $1::timestamptz + interval '1 hour'),
		('second-day', 0, 'duplicate', $1::timestamptz + interval '25 hours')`, bound)

	// Writers into the second day while the first day and the legacy partition go.
	var wrote, failed atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := pool.Exec(ctx, `INSERT INTO processed_job_events (idempotency_key, generation, kind, at)
				VALUES ('meanwhile', 0, 'busy', $1::timestamptz + interval '26 hours')`, bound); err != nil {
				failed.Add(1)
			} else {
				wrote.Add(1)
			}
		}
	}()
	// An hour's window on a clock two hours past the first day's end: the legacy partition
	// (ended at bound) and the first day (ended a day later) are past it.
	now := bound.Add(26 * time.Hour)
	_, err := l.purgeHistory(ctx, now, time.Hour)
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if failed.Load() != 0 || wrote.Load() == 0 {
		t.Fatalf("writers meanwhile: %d written, %d failed; want some written and none failed", wrote.Load(), failed.Load())
	}
	left := testenv.Strings(t, pool, `SELECT DISTINCT idempotency_key FROM processed_job_events ORDER BY 1`)
	if len(left) != 2 || left[0] != "meanwhile" || left[1] != "second-day" {
		t.Fatalf("events left: %q; want the second day's and those written meanwhile", left)
	}
	if n := testenv.Count(t, pool, `SELECT count(*) FROM processed_job_events WHERE idempotency_key = 'meanwhile'`); int64(n) != wrote.Load() {
		t.Fatalf("%d of the %d events written meanwhile kept", n, wrote.Load())
	}
	after := days()
	// From the second day (bound + 1 day, the day now is in) to the 7th day after it: 8.
	if len(after) != 8 || after[0] != "processed_job_events_p"+bound.AddDate(0, 0, 1).UTC().Format("20060102") {
		t.Fatalf("partitions after the round: %q; want 8, from the second day", after)
	}
	mu.Lock()
	if dropped[PurgeEvents] != 2 {
		t.Errorf("ObservePurge saw %d drops of %s, want 2", dropped[PurgeEvents], PurgeEvents)
	}
	mu.Unlock()
	// Run again, nothing more to do; then an event 8 days after now has a partition.
	if _, err := l.purgeHistory(context.WithoutCancel(ctx), now, time.Hour); err != nil {
		t.Fatal(err)
	}
	if again := days(); len(again) != len(after) {
		t.Fatalf("a second round changed the partitions: %q, then %q", after, again)
	}
	testenv.Exec(t, pool, `INSERT INTO processed_job_events (idempotency_key, generation, kind, at) VALUES ('late', 0, 'busy', $1::timestamptz + interval '7 days')`, now)
}

// A transaction left open after reading the history holds a day's detach: the round gives
// up after historyDropWait instead of waiting with it, and a round after the transaction
// ended finishes the detach left pending and drops the day.
func TestPurgeHistoryDoesNotWaitForAnOpenTransaction(t *testing.T) {
	pool := testenv.Postgres(t)
	ctx := testenv.Context(t, time.Minute)
	l := New(pool, nil)
	defer l.Close()
	wait := historyDropWait
	historyDropWait = 2 * time.Second
	t.Cleanup(func() { historyDropWait = wait })

	days, err := store.EventDays(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	bound := days[0].Upper // where the legacy partition ends
	reader, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Rollback(context.WithoutCancel(ctx))
	if _, err := reader.Exec(ctx, `SELECT count(*) FROM processed_job_events`); err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	_, err = l.purgeHistory(ctx, bound.Add(2*time.Hour), time.Hour)
	if err == nil || time.Since(began) > 20*time.Second {
		t.Fatalf("a round beside an open reader: %v after %s; want an error within about %s", err, time.Since(began), historyDropWait)
	}
	if err := reader.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := l.purgeHistory(ctx, bound.Add(2*time.Hour), time.Hour); err != nil {
		t.Fatalf("the round after the reader ended: %v", err)
	}
	after, err := store.EventDays(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range after {
		if d.Name == "processed_job_events_legacy" || d.DetachPending {
			t.Fatalf("partition %s still attached (pending %v) after the second round", d.Name, d.DetachPending)
		}
	}
}
