package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/internal/testenv"
)

// historyCounts counts Config.ObserveHistory's reports by outcome.
type historyCounts struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *historyCounts) observe(outcome string, n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[outcome] += n
}

func (c *historyCounts) get(outcome string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[outcome]
}

// countEvents counts key's events of generation gen (-1: all).
func countEvents(t *testing.T, pool *pgxpool.Pool, key string, gen int) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_job_events
		WHERE idempotency_key = $1 AND ($2 < 0 OR generation = $2)`, key, gen).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestHistoryCapPerGeneration(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ctx := testenv.Context(t, time.Minute)
	batch := func(key string, gen, n int, detail string) []store.EventParams {
		es := make([]store.EventParams, n)
		for i := range es {
			es[i] = store.EventParams{Key: key, Generation: gen, Kind: string(HistoryDuplicate), Detail: fmt.Sprintf("%s%d", detail, i)}
		}
		return es
	}
	// 51 in one statement: the 51st is not kept.
	if err := store.WriteEvents(ctx, pool, batch("k", 0, 51, "a")); err != nil {
		t.Fatal(err)
	}
	if n := countEvents(t, pool, "k", 0); n != store.MaxEventsPerGeneration {
		t.Fatalf("51 events in one batch: %d kept, want %d", n, store.MaxEventsPerGeneration)
	}
	var last string
	if err := pool.QueryRow(ctx, `SELECT detail FROM processed_job_events WHERE idempotency_key = 'k' ORDER BY id DESC LIMIT 1`).Scan(&last); err != nil || last != "a49" {
		t.Fatalf("the newest kept event is %q (%v), want a49: the first 50 are kept", last, err)
	}
	// A later batch finds the generation full; another generation, and another key, are not.
	if err := store.WriteEvents(ctx, pool, append(append(batch("k", 0, 5, "b"), batch("k", 1, 3, "c")...), batch("j", 0, 2, "d")...)); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		key       string
		gen, want int
	}{{"k", 0, 50}, {"k", 1, 3}, {"j", 0, 2}} {
		if n := countEvents(t, pool, c.key, c.gen); n != c.want {
			t.Errorf("%s generation %d: %d events, want %d", c.key, c.gen, n, c.want)
		}
	}
	// Two statements of 30: 50 kept.
	for range 2 {
		if err := store.WriteEvents(ctx, pool, batch("m", 0, 30, "e")); err != nil {
			t.Fatal(err)
		}
	}
	if n := countEvents(t, pool, "m", 0); n != 50 {
		t.Errorf("30 + 30 events: %d kept, want 50", n)
	}
	// What the table's checks refuse is cleaned or left out, never an error.
	bad := []store.EventParams{
		{Key: "n", Kind: "Not-A-Kind"},
		{Key: "n", Kind: string(HistoryBusy), Detail: string(make([]byte, 5000)) + "\xff", TaskType: "t\x00"},
	}
	if err := store.WriteEvents(ctx, pool, bad); err != nil {
		t.Fatalf("events the checks would refuse: %v, want them cleaned or left out", err)
	}
	if n := countEvents(t, pool, "n", -1); n != 1 {
		t.Errorf("bad events: %d written, want 1 (the one with a valid kind, its detail cut)", n)
	}
}

// A purged key's events are not deleted with its row: they go with their day
// (TestPurgeDropsHistoryByTheDay). A rerun keeps a key's older generations' events.
func TestHistoryOutlivesItsPurgedRowKeptByRerun(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	l := New(pool, nil)
	defer l.Close()
	ctx := testenv.Context(t, time.Minute)
	testenv.Exec(t, pool, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, started_at, completed_at)
		VALUES ('old', 't', 'completed', nextval('processed_jobs_fence_seq'), gen_random_uuid(), now() - interval '3 days', now() - interval '2 days'),
		       ('new', 't', 'completed', nextval('processed_jobs_fence_seq'), gen_random_uuid(), now(), now())`)
	es := []store.EventParams{{Key: "old", Kind: "duplicate"}, {Key: "old", Kind: "mismatch"}, {Key: "new", Kind: "duplicate"}}
	if err := store.WriteEvents(ctx, pool, es); err != nil {
		t.Fatal(err)
	}
	if n, err := l.Purge(ctx, 24*time.Hour, 100); err != nil || n != 1 {
		t.Fatalf("Purge: %d, %v; want 1 row", n, err)
	}
	if n := countEvents(t, pool, "old", -1); n != 2 {
		t.Errorf("a purged key keeps %d events, want its 2 until their day is dropped", n)
	}
	if n := countEvents(t, pool, "new", -1); n != 1 {
		t.Errorf("a key not purged has %d events, want its 1", n)
	}
	// A rerun keeps the older generations' events and starts the new one's with its own.
	if _, err := l.Rerun(ctx, "new"); err != nil {
		t.Fatal(err)
	}
	h, err := l.History(ctx, "new")
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != 2 || h[0].Kind != HistoryDuplicate || h[0].Generation != 0 || h[1].Kind != HistoryRerun || h[1].Generation != 1 ||
		h[1].Worker != store.Worker || h[1].Fence == 0 {
		t.Fatalf("history after a rerun: %+v; want the duplicate (generation 0) then the rerun (generation 1, this worker, its fence)", h)
	}
}

func TestHistoryFullBufferDropsAndCounts(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	var counts historyCounts
	l := New(pool, &Config{ObserveHistory: counts.observe})
	l.hist.max, l.hist.delay = 3, time.Hour
	for i := range 5 {
		l.Record(HistoryEvent{Key: "k", Kind: HistoryBusy, Detail: fmt.Sprint(i)})
	}
	if got := counts.get(HistoryDropped); got != 2 {
		t.Fatalf("5 events into a buffer of 3: %d dropped, want 2", got)
	}
	if n := countEvents(t, pool, "k", -1); n != 0 {
		t.Fatalf("%d events written before any round or flush, want none", n)
	}
	l.Close() // writes what waits
	if n := countEvents(t, pool, "k", -1); n != 3 || counts.get(HistoryWritten) != 3 {
		t.Fatalf("after Close: %d events in the table, %d counted written; want 3 and 3", n, counts.get(HistoryWritten))
	}
}

// A duplicate's event is not a statement of its own: it waits in the buffer (the flush is
// an hour away here) and is written by the next leased round, which another key's claim
// sends.
func TestHistoryEventRidesTheNextRound(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	var counts historyCounts
	l := New(pool, &Config{ObserveHistory: counts.observe})
	defer l.Close()
	l.hist.delay = time.Hour
	ctx := testenv.Context(t, time.Minute)
	if _, err := l.Do(ctx, Request{Key: "a", TaskType: "t"}, func(context.Context) (json.RawMessage, error) {
		return json.RawMessage(`1`), nil
	}); err != nil {
		t.Fatal(err)
	}
	res, err := l.Claim(ctx, Request{Key: "a", TaskType: "t", TaskID: "a-task"})
	if err != nil || res.Completed == nil {
		t.Fatalf("duplicate claim: %+v, %v", res, err)
	}
	if n := countEvents(t, pool, "a", -1); n != 0 {
		t.Fatalf("the duplicate's event was written at once (%d rows): it should wait for the next round", n)
	}
	if _, err := l.Claim(ctx, Request{Key: "b", TaskType: "t"}); err != nil {
		t.Fatal(err)
	}
	h, err := l.History(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != 1 || h[0].Kind != HistoryDuplicate || h[0].TaskID != "a-task" || h[0].Worker != store.Worker || h[0].Fence != res.Completed.Fence {
		t.Fatalf("history of a after the next round: %+v; want its duplicate, with the TaskID, this worker and the completed fence", h)
	}
	if got := counts.get(HistoryWritten); got != 1 {
		t.Fatalf("%d events counted written, want 1", got)
	}
}

// A round the server refuses because of its events (here: the table is gone) is sent
// again without them: the claim it carried is not failed by its history.
func TestHistoryRefusedEventsNeverFailARound(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	var counts historyCounts
	l := New(pool, &Config{ObserveHistory: counts.observe})
	l.hist.delay = time.Hour
	ctx := testenv.Context(t, time.Minute)
	testenv.Exec(t, pool, `ALTER TABLE processed_job_events RENAME TO processed_job_events_gone`)
	l.Record(HistoryEvent{Key: "x", Kind: HistoryBusy})
	res, err := l.Claim(ctx, Request{Key: "c", TaskType: "t"})
	if err != nil || res.Claim == nil {
		t.Fatalf("claim in a round refused for its events: %+v, %v; want it claimed", res, err)
	}
	if err := l.Complete(ctx, res.Claim, json.RawMessage(`1`)); err != nil {
		t.Fatalf("complete after the events were refused: %v", err)
	}
	l.Close() // the flush writes them alone: it fails, and they are counted lost
	if got := counts.get(HistoryFailed); got != 1 {
		t.Fatalf("%d events counted failed, want 1", got)
	}
}

// A DoTx delivery that takes over a lapsed leased claim records the takeover with both
// fences, as a leased one does.
func TestHistoryTakeoverFences(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	l := New(pool, nil)
	defer l.Close()
	ctx := testenv.Context(t, time.Minute)
	var fences []int64
	for _, key := range []string{"leased", "tx"} {
		first, err := l.Claim(ctx, Request{Key: key, TaskType: "t", Deadline: time.Now().Add(200 * time.Millisecond)})
		if err != nil {
			t.Fatal(err)
		}
		fences = append(fences, first.Claim.Fence)
	}
	time.Sleep(400 * time.Millisecond)
	var taken []int64
	res, err := l.Claim(ctx, Request{Key: "leased", TaskType: "t", TaskID: "leased"})
	if err != nil || res.Claim == nil {
		t.Fatal(res, err)
	}
	taken = append(taken, res.Claim.Fence)
	var txFence int64
	if _, err := l.DoTx(ctx, Request{Key: "tx", TaskType: "t", TaskID: "tx"}, func(ctx context.Context, _ pgx.Tx) (json.RawMessage, error) {
		_, txFence, _ = FromContext(ctx)
		return json.RawMessage(`1`), nil
	}); err != nil {
		t.Fatal(err)
	}
	taken = append(taken, txFence)
	l.hist.write()
	for i, key := range []string{"leased", "tx"} {
		h, err := l.History(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if len(h) != 1 || h[0].Kind != HistoryTakeover || h[0].OldFence != fences[i] || h[0].Fence != taken[i] || h[0].TaskID != key {
			t.Errorf("%s: history %+v; want a takeover from fence %d to %d with TaskID %s", key, h, fences[i], taken[i], key)
		}
	}
}

// A DoTx finish carries the waiting events after its COMMIT, in the same round trip, once
// an events statement has been written in the process.
func TestHistoryEventRidesADoTxCommit(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	l := New(pool, nil)
	defer l.Close()
	l.hist.delay = time.Hour
	ctx := testenv.Context(t, time.Minute)
	run := func(key string) {
		t.Helper()
		if _, err := l.DoTx(ctx, Request{Key: key, TaskType: "t"}, func(context.Context, pgx.Tx) (json.RawMessage, error) {
			return json.RawMessage(`1`), nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	l.Record(HistoryEvent{Key: "first", Kind: HistoryBusy})
	run("a")
	if n := countEvents(t, pool, "first", -1); n != 0 {
		t.Fatalf("an event rode a DoTx commit before any events statement was written (%d rows)", n)
	}
	l.hist.write() // the background write: now proven
	if n := countEvents(t, pool, "first", -1); n != 1 {
		t.Fatalf("the background write wrote %d events, want 1", n)
	}
	run("a") // a duplicate: its event waits
	if n := countEvents(t, pool, "a", -1); n != 0 {
		t.Fatalf("the duplicate's event was written at once (%d rows)", n)
	}
	run("b")
	h, err := l.History(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != 1 || h[0].Kind != HistoryDuplicate {
		t.Fatalf("history of a after the next DoTx commit: %+v; want its duplicate", h)
	}
}

// A completion refused because an operator released the lease records lease_lost with
// the stale claim's fence.
func TestHistoryLeaseLost(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	l := New(pool, nil)
	defer l.Close()
	ctx := testenv.Context(t, time.Minute)
	res, err := l.Claim(ctx, Request{Key: "k", TaskType: "t", TaskID: "k"})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	if err := l.Complete(ctx, res.Claim, json.RawMessage(`1`)); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("complete after release: %v, want ErrLeaseLost", err)
	}
	l.hist.write()
	h, err := l.History(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != 1 || h[0].Kind != HistoryLeaseLost || h[0].Fence != res.Claim.Fence || h[0].TaskID != "k" || h[0].OldFence != 0 {
		t.Fatalf("history: %+v; want one lease_lost of fence %d", h, res.Claim.Fence)
	}
}

// The background write takes events only once they have waited HistoryFlushDelay: a
// process whose rounds carry its events writes none by itself.
func TestHistoryFlushWaitsForTheDelay(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	l := New(pool, nil)
	defer l.Close()
	l.hist.delay = time.Hour
	l.Record(HistoryEvent{Key: "k", Kind: HistoryBusy})
	l.hist.flush() // as a timer armed by an earlier event would, before this one waited
	if n := countEvents(t, pool, "k", -1); n != 0 {
		t.Fatalf("a flush wrote an event that had not waited the delay (%d rows)", n)
	}
	l.hist.mu.Lock()
	l.hist.since = time.Now().Add(-2 * time.Hour)
	l.hist.mu.Unlock()
	l.hist.flush()
	if n := countEvents(t, pool, "k", -1); n != 1 {
		t.Fatalf("a flush after the delay wrote %d events, want 1", n)
	}
}

// The events a DoTx finish carries after its COMMIT commit asynchronously (the history is
// best-effort; a second WAL flush would hold the finish's answer), and that setting ends
// with their transaction: the connection, which later runs users' transactions, still
// commits synchronously. One connection, so every statement below runs on the finish's.
func TestHistoryAsyncCommitStaysInTheEventsTransaction(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, testenv.PostgresURL(t)+"&pool_max_conns=1")
	l := New(pool, nil)
	defer l.Close()
	l.hist.delay = time.Hour
	ctx := testenv.Context(t, time.Minute)
	l.Record(HistoryEvent{Key: "first", Kind: HistoryBusy})
	l.hist.write() // proven: finishes carry events from now on
	l.Record(HistoryEvent{Key: "second", Kind: HistoryBusy})
	var inTx string
	if _, err := l.DoTx(ctx, Request{Key: "k", TaskType: "t"}, func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		return json.RawMessage(`1`), tx.QueryRow(ctx, "SHOW synchronous_commit").Scan(&inTx)
	}); err != nil {
		t.Fatal(err)
	}
	if n := countEvents(t, pool, "second", -1); n != 1 {
		t.Fatalf("the finish carried %d events of second, want 1", n)
	}
	var after string
	if err := pool.QueryRow(ctx, "SHOW synchronous_commit").Scan(&after); err != nil {
		t.Fatal(err)
	}
	if inTx != "on" || after != "on" {
		t.Fatalf("synchronous_commit in the job's transaction %q, on the connection after the finish %q; want on, on", inTx, after)
	}
}

// With NoDuplicateHistory a delivery answered from the ledger records nothing in its
// key's history (it is still observed as a cache hit), and a mismatch still does.
func TestHistoryWithoutDuplicates(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	hits := 0
	var mu sync.Mutex
	l := New(pool, &Config{NoDuplicateHistory: true, Observe: func(ev Event, _ string) {
		if ev == EventCacheHit {
			mu.Lock()
			hits++
			mu.Unlock()
		}
	}})
	defer l.Close()
	ctx := testenv.Context(t, time.Minute)
	run := func(payload string) error {
		_, err := l.DoTx(ctx, Request{Key: "k", TaskType: "t", Fingerprint: Fingerprint("t", []byte(payload))},
			func(context.Context, pgx.Tx) (json.RawMessage, error) { return json.RawMessage(`1`), nil })
		return err
	}
	if err := run("a"); err != nil {
		t.Fatal(err)
	}
	if err := run("a"); err != nil { // a duplicate
		t.Fatal(err)
	}
	var mismatch *MismatchError
	if err := run("b"); !errors.As(err, &mismatch) {
		t.Fatalf("another payload: %v, want a mismatch", err)
	}
	l.hist.write()
	h, err := l.History(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(h) != 1 || h[0].Kind != HistoryMismatch || hits != 1 {
		t.Fatalf("history %+v and %d cache hits; want the mismatch alone and 1 hit", h, hits)
	}
}

// A lock on processed_job_events (VACUUM FULL, a migration's ALTER) never holds a
// delivery: the history is best-effort. With the table locked ACCESS EXCLUSIVE by another
// session, DoTx and leased deliveries that carry events complete and commit while the lock
// is still held, on connections that never sent the events statement before (nothing
// prepared, no cached description), and the events they could not write are counted.
func TestHistoryLockedTableNeverHoldsADelivery(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	var counts historyCounts
	l := New(pool, &Config{ObserveHistory: counts.observe})
	defer l.Close()
	l.hist.delay = time.Hour
	l.hist.proven.Store(true) // finishes carry events, as after a first written statement
	ctx := testenv.Context(t, time.Minute)

	locker, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Release()
	if _, err := locker.Exec(ctx, `BEGIN; LOCK TABLE processed_job_events IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	defer locker.Exec(context.Background(), `ROLLBACK`)
	lockHeld := func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE pid = $1 AND granted
			AND mode = 'AccessExclusiveLock' AND relation = 'processed_job_events'::regclass`, locker.Conn().PgConn().PID()).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	}

	// Each delivery gets 20 s, far below what it would wait for the lock (forever): one
	// that waited would fail with its deadline.
	// A refused events statement keeps rounds from carrying events for a while; each
	// delivery here is to carry some.
	carry := func(key string) {
		l.hist.mu.Lock()
		l.hist.aloneUntil = time.Time{}
		l.hist.mu.Unlock()
		l.Record(HistoryEvent{Key: "ev-" + key, Kind: HistoryBusy})
	}
	for _, key := range []string{"tx-1", "tx-2"} {
		carry(key)
		dctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		_, err := l.DoTx(dctx, Request{Key: key, TaskType: "t"}, func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			_, err := tx.Exec(ctx, `SELECT 1`)
			return json.RawMessage(`1`), err
		})
		cancel()
		if err != nil {
			t.Fatalf("DoTx %s with processed_job_events locked: %v", key, err)
		}
	}
	for _, key := range []string{"leased-1", "leased-2"} {
		carry(key)
		dctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		_, err := l.Do(dctx, Request{Key: key, TaskType: "t"}, func(context.Context) (json.RawMessage, error) {
			return json.RawMessage(`1`), nil
		})
		cancel()
		if err != nil {
			t.Fatalf("Do %s with processed_job_events locked: %v", key, err)
		}
	}
	l.hist.write() // the background write gives up too
	if !lockHeld() {
		t.Fatal("the lock on processed_job_events was no longer held when the deliveries completed")
	}
	if n := testenv.Count(t, pool, `SELECT count(*) FROM processed_jobs WHERE status = 'completed'`); n != 4 {
		t.Fatalf("%d rows completed, want 4", n)
	}
	if lost := counts.get(HistoryFailed) + counts.get(HistoryDropped); lost != 4 || counts.get(HistoryWritten) != 0 {
		t.Fatalf("events counted %v; want 4 lost (failed or dropped), none written", counts.n)
	}
}
