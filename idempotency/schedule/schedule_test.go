package schedule_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/idempotency/schedule"
	"github.com/idemq/idemq/internal/testenv"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// simClock is the simulated time; each replica reads it with its own offset.
type simClock struct{ now time.Time }

// fleet starts scheduler replicas on one database, each with its own clock offset.
type fleet struct {
	t      *testing.T
	ctx    context.Context
	pool   *pgxpool.Pool
	client *outbox.Client
	clock  *simClock
}

func newFleet(t *testing.T) *fleet {
	t.Helper()
	pool := testenv.Postgres(t)
	// The simulation starts after the entries' first revision (the database's clock).
	start := time.Now().UTC().Truncate(time.Minute).Add(time.Minute)
	return &fleet{t: t, ctx: testenv.Context(t, 3*time.Minute), pool: pool,
		client: outbox.NewClient(pool, testenv.Redis(t), nil), clock: &simClock{now: start}}
}

// replica is a started scheduler (Sync done) whose clock is the simulation's plus offset.
func (f *fleet) replica(entries []schedule.Entry, offset time.Duration) *schedule.Scheduler {
	f.t.Helper()
	s, err := schedule.New(f.pool, f.client, entries, &schedule.Config{Logger: quiet,
		Now: func() time.Time { return f.clock.now.Add(offset) }, DatabaseNow: f.dbNow})
	if err != nil {
		f.t.Fatal(err)
	}
	if err := s.Sync(f.ctx); err != nil {
		f.t.Fatal(err)
	}
	return s
}

// dbNow is the database's clock in the simulation: its time, without a replica's offset.
func (f *fleet) dbNow() time.Time { return f.clock.now }

func (f *fleet) tick(s *schedule.Scheduler) schedule.TickStats {
	f.t.Helper()
	st, err := s.Tick(f.ctx)
	if err != nil {
		f.t.Fatal(err)
	}
	return st
}

// jobs returns the payload of each job of entry name, by key.
func (f *fleet) jobs(name string) map[string]string {
	f.t.Helper()
	rows, err := f.pool.Query(f.ctx, `SELECT idempotency_key, convert_from(payload, 'UTF8') FROM job_intents WHERE idempotency_key LIKE $1`, "cron:"+name+":%")
	if err != nil {
		f.t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]string{}
	for rows.Next() {
		var k, p string
		if err := rows.Scan(&k, &p); err != nil {
			f.t.Fatal(err)
		}
		out[k] = p
	}
	if err := rows.Err(); err != nil {
		f.t.Fatal(err)
	}
	return out
}

func (f *fleet) lastTick(name string) time.Time {
	f.t.Helper()
	var t time.Time
	if err := f.pool.QueryRow(f.ctx, `SELECT last_tick FROM schedule_entries WHERE name = $1`, name).Scan(&t); err != nil {
		f.t.Fatal(err)
	}
	return t.UTC()
}

// every returns the instants of a schedule of period d (aligned to the epoch, as cron's
// minutes are) in (after, upTo].
func every(d time.Duration, after, upTo time.Time) []time.Time {
	var out []time.Time
	for t := after.Truncate(d).Add(d); !t.After(upTo); t = t.Add(d) {
		out = append(out, t)
	}
	return out
}

// TestReplicasEnqueueEveryTickOnce runs three replicas over a simulated day, their clocks
// off by up to 29 s: one replica away for two hours, every replica down for 50 minutes
// (then restarted, one first), an entry changed mid-run. Every tick is one job; the ticks
// missed during the outage follow each entry's catch-up policy.
func TestReplicasEnqueueEveryTickOnce(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	entries := []schedule.Entry{
		{Name: "minutely", Schedule: "* * * * *", TaskType: "report:build", Payload: []byte(`{"v":1}`)},
		{Name: "every90", Schedule: "@every 90s", TaskType: "sync:pull"},
		{Name: "latest", Schedule: "*/5 * * * *", TaskType: "mail:digest", CatchUp: schedule.CatchUpLatest},
		{Name: "none", Schedule: "*/5 * * * *", TaskType: "cache:warm", CatchUp: schedule.CatchUpNone},
	}
	offsets := []time.Duration{0, 17 * time.Second, -29 * time.Second}
	start := f.clock.now
	var revisedAt time.Time
	if err := f.pool.QueryRow(f.ctx, `SELECT now()`).Scan(&revisedAt); err != nil {
		t.Fatal(err)
	}
	replicas := make([]*schedule.Scheduler, len(offsets))
	for i, o := range offsets {
		replicas[i] = f.replica(entries, o)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	step := func() { f.clock.now = f.clock.now.Add(time.Duration(10+rng.IntN(50)) * time.Second) }
	until := func(h time.Duration, alive ...int) {
		for f.clock.now.Before(start.Add(h)) {
			step()
			for _, i := range alive {
				f.tick(replicas[i])
			}
		}
	}
	until(3*time.Hour, 0, 1, 2)
	until(5*time.Hour, 0, 1) // replica 2 is away for two hours, then back as it was
	until(10*time.Hour, 0, 1, 2)

	// Every replica down for 50 minutes, then restarted (new processes): replica 0 first,
	// alone for two rounds.
	lastLatest, lastNone := f.lastTick("latest"), f.lastTick("none")
	f.clock.now = f.clock.now.Add(50 * time.Minute)
	for i, o := range offsets {
		replicas[i] = f.replica(entries, o)
	}
	restart := f.clock.now // replica 0's clock, offset 0
	st := f.tick(replicas[0])
	if st.CaughtUp == 0 || st.Skipped == 0 {
		t.Errorf("the first round after the outage: %+v, want ticks caught up and skipped", st)
	}
	step()
	f.tick(replicas[0])
	until(15*time.Hour, 0, 1, 2)

	// The minutely entry changes (a replica starts with a new file); the others follow
	// the table from their next round.
	changed := slices.Clone(entries)
	changed[0].Payload = []byte(`{"v":2}`)
	replicas[1] = f.replica(changed, offsets[1])
	change := f.clock.now
	until(24*time.Hour, 0, 1, 2)
	end := f.clock.now

	// The minutely and every90 entries: every tick once, the outage's caught up.
	first := start.Add(offsets[2]) // no replica looked before; the first looks catch up
	for _, c := range []struct {
		name   string
		period time.Duration
	}{{"minutely", time.Minute}, {"every90", 90 * time.Second}} {
		got := f.jobs(c.name)
		for _, tick := range every(c.period, latest(revisedAt, first.Add(-time.Hour)), end.Add(offsets[2])) {
			k := schedule.TickKey(c.name, tick)
			if _, ok := got[k]; !ok {
				t.Errorf("%s: no job for tick %s", c.name, k)
			}
			delete(got, k)
		}
		for k := range got {
			tick, err := time.Parse(schedule.TickLayout, k[len(k)-len(schedule.TickLayout):])
			if err != nil || tick.After(end.Add(offsets[1])) || tick.Unix()%int64(c.period/time.Second) != 0 {
				t.Errorf("%s: a job for no tick due: %s", c.name, k)
			}
		}
	}
	for k, p := range f.jobs("minutely") {
		var job struct {
			schedule.Tick
			V int `json:"v"`
		}
		if err := json.Unmarshal([]byte(p), &job); err != nil || job.Key() != k {
			t.Fatalf("%s: payload %s decodes to key %q (%v), want its own", k, p, job.Key(), err)
		}
		switch {
		case job.At.Before(change.Add(offsets[2])) && job.V != 1:
			t.Errorf("%s before the change has payload %s", k, p)
		case job.At.After(change.Add(time.Minute)) && job.V != 2:
			t.Errorf("%s after the change has payload %s", k, p)
		}
	}

	// The outage's ticks: latest keeps the newest missed one, none keeps none.
	missed := every(5*time.Minute, lastLatest, restart)
	if len(missed) < 9 {
		t.Fatalf("the outage missed %d ticks of */5, want about 10", len(missed))
	}
	got := f.jobs("latest")
	for i, tick := range missed {
		_, ok := got[schedule.TickKey("latest", tick)]
		if last := i == len(missed)-1; ok != last {
			t.Errorf("latest: tick %s enqueued %t, want %t", tick.Format(schedule.TickLayout), ok, last)
		}
	}
	got = f.jobs("none")
	for _, tick := range every(5*time.Minute, lastNone, restart) {
		if _, ok := got[schedule.TickKey("none", tick)]; ok {
			t.Errorf("none: the missed tick %s was enqueued", tick.Format(schedule.TickLayout))
		}
	}
	for _, tick := range every(5*time.Minute, restart.Add(time.Minute), end.Add(offsets[2])) {
		if _, ok := got[schedule.TickKey("none", tick)]; !ok {
			t.Errorf("none: no job for tick %s after the restart", tick.Format(schedule.TickLayout))
		}
	}
}

func latest(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// TestPauseOverlapManualRemove: a paused entry skips its ticks and does not catch them
// up when resumed; an overlap-skip entry waits for its job; a manual run is keyed by its
// id; a removed entry enqueues nothing more.
func TestPauseOverlapManualRemove(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	entries := []schedule.Entry{
		{Name: "paused", Schedule: "* * * * *", TaskType: "t:a"},
		{Name: "single", Schedule: "* * * * *", TaskType: "t:b", Overlap: schedule.OverlapSkip},
	}
	s := f.replica(entries, 0)
	f.tick(s)
	if err := schedule.Pause(f.ctx, f.pool, "paused"); err != nil {
		t.Fatal(err)
	}
	if err := schedule.Pause(f.ctx, f.pool, "nope"); !errors.Is(err, schedule.ErrNoEntry) {
		t.Errorf("pause of no entry: %v, want ErrNoEntry", err)
	}
	before := len(f.jobs("paused"))
	f.clock.now = f.clock.now.Add(5 * time.Minute)
	if st := f.tick(s); st.Skipped < 5 {
		t.Errorf("a paused entry and a busy one over 5 minutes: %+v, want at least 5 skipped", st)
	}
	if n := len(f.jobs("paused")); n != before {
		t.Errorf("a paused entry enqueued %d jobs", n-before)
	}
	if err := schedule.Resume(f.ctx, f.pool, "paused"); err != nil {
		t.Fatal(err)
	}
	f.clock.now = f.clock.now.Add(time.Minute)
	f.tick(s)
	if n := len(f.jobs("paused")); n != before+1 {
		t.Errorf("after resume: %d new jobs, want 1 (the paused ticks are not caught up)", n-before)
	}

	// single's first job is unfinished: no more of its ticks until it is done.
	if n := len(f.jobs("single")); n != 1 {
		t.Fatalf("single: %d jobs while its first is unfinished, want 1", n)
	}
	if _, err := f.pool.Exec(f.ctx, `UPDATE job_intents SET state = 'done', finished_at = now() WHERE idempotency_key LIKE 'cron:single:%'`); err != nil {
		t.Fatal(err)
	}
	f.clock.now = f.clock.now.Add(3 * time.Minute)
	f.tick(s)
	if n := len(f.jobs("single")); n != 2 {
		t.Errorf("single: %d jobs once the first was done and 3 ticks passed, want 2 (the newest tick only)", n)
	}

	// A manual run: its id is its identity, whenever it is asked again.
	for i := range 3 {
		res, err := schedule.RunNow(f.ctx, f.pool, f.client, "paused", "backfill-1", f.clock.now.Add(time.Duration(i/2)*time.Second))
		if err != nil {
			t.Fatalf("manual run, ask %d: %v", i+1, err)
		}
		if res.Duplicate != (i > 0) {
			t.Errorf("manual run, ask %d: duplicate %t", i+1, res.Duplicate)
		}
	}
	manual, ok := f.jobs("paused")[schedule.ManualKey("paused", "backfill-1")]
	want := `{"schedule_entry":"paused","tick":"` + f.clock.now.UTC().Truncate(time.Second).Format(time.RFC3339) + `","manual_run":"backfill-1"}`
	if !ok || manual != want {
		t.Errorf("the manual run's job: %q (found %t), want %s", manual, ok, want)
	}
	if _, err := schedule.RunNow(f.ctx, f.pool, f.client, "paused", "bad id", f.clock.now); !errors.Is(err, idempotency.ErrInvalidKey) {
		t.Errorf("a manual run id with a space: %v, want ErrInvalidKey", err)
	}
	if _, err := schedule.RunNow(f.ctx, f.pool, f.client, "nope", "x", f.clock.now); !errors.Is(err, schedule.ErrNoEntry) {
		t.Errorf("a manual run of no entry: %v, want ErrNoEntry", err)
	}

	// A replica started without "paused" removes it: nothing more from anyone.
	s2 := f.replica(entries[1:], 0)
	n := len(f.jobs("paused"))
	f.clock.now = f.clock.now.Add(5 * time.Minute)
	f.tick(s)
	f.tick(s2)
	if got := len(f.jobs("paused")); got != n {
		t.Errorf("a removed entry enqueued %d jobs", got-n)
	}
	list, err := schedule.List(f.ctx, f.pool, f.clock.now)
	if err != nil || len(list) != 1 || list[0].Name != "single" || list[0].LastKey == "" || list[0].Next.IsZero() {
		t.Errorf("List: %+v %v, want single with its last job and next tick", list, err)
	}
}

func TestNewRefusesAWindowPastRetention(t *testing.T) {
	t.Parallel()
	_, err := schedule.New(nil, nil, []schedule.Entry{{Name: "long", Schedule: "@daily", TaskType: "t", CatchUpWindow: 48 * time.Hour}},
		&schedule.Config{Retention: 24 * time.Hour})
	var ee *schedule.EntryError
	if !errors.As(err, &ee) || ee.Field != "catch_up_window" || !strings.Contains(err.Error(), "retention") {
		t.Fatalf("a 48h window with a 24h retention: %v, want an error on catch_up_window naming the retention", err)
	}
}

// TestUnsafeWallClockKeysNameATickTwice is the knob of the fault suite's negative
// control: two replicas whose clocks are 700 ms apart, keying ticks by their clock
// readings, record two jobs for one tick; keyed by the scheduled instant, one.
func TestUnsafeWallClockKeysNameATickTwice(t *testing.T) {
	t.Parallel()
	for _, wall := range []bool{false, true} {
		f := newFleet(t)
		name := "wall"
		entries := []schedule.Entry{{Name: name, Schedule: "@every 2s", TaskType: "wallet:settle", CatchUp: schedule.CatchUpNone}}
		var replicas []*schedule.Scheduler
		for _, offset := range []time.Duration{0, 700 * time.Millisecond} {
			s, err := schedule.New(f.pool, f.client, entries, &schedule.Config{Logger: quiet, UnsafeWallClockKeys: wall,
				Now: func() time.Time { return f.clock.now.Add(offset) }, DatabaseNow: f.dbNow})
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Sync(f.ctx); err != nil {
				t.Fatal(err)
			}
			replicas = append(replicas, s)
		}
		tick := f.clock.now.Add(10 * time.Second)
		for _, s := range replicas {
			f.clock.now = tick.Add(-1500 * time.Millisecond) // a first look: nothing caught up
			f.tick(s)
		}
		for _, s := range replicas {
			f.clock.now = tick.Add(500 * time.Millisecond)
			f.tick(s)
		}
		jobs := f.jobs(name)
		want := []string{schedule.Tick{Entry: name, At: tick}.Key()}
		if wall {
			want = append(want, schedule.Tick{Entry: name, At: tick.Add(time.Second)}.Key())
		}
		var got []string
		for k := range jobs {
			got = append(got, k)
		}
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Errorf("UnsafeWallClockKeys=%t: the tick %s was recorded as %q, want %q", wall, tick.Format(schedule.TickLayout), got, want)
		}
	}
}

// TestReaddedEntryReplacesTheOldOnAReplicaThatWasAway: an entry removed and then added
// again with another definition starts again at revision 1; a replica that ran no round
// meanwhile enqueues the new definition, not the one it knew under that revision.
func TestReaddedEntryReplacesTheOldOnAReplicaThatWasAway(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	away := f.replica([]schedule.Entry{{Name: "re", Schedule: "* * * * *", TaskType: "t", Payload: []byte(`{"v":1}`)}}, 0)
	f.tick(away)
	f.replica([]schedule.Entry{}, 0) // removes it
	f.replica([]schedule.Entry{{Name: "re", Schedule: "* * * * *", TaskType: "t", Payload: []byte(`{"v":2}`)}}, 0)
	before := f.jobs("re")
	f.clock.now = f.clock.now.Add(3 * time.Minute)
	f.tick(away)
	var n int
	for k, p := range f.jobs("re") {
		if _, old := before[k]; old {
			continue
		}
		n++
		if !strings.Contains(p, `"v":2`) {
			t.Errorf("%s after the entry was re-added with v 2: %s", k, p)
		}
	}
	if n == 0 {
		t.Errorf("no job of the re-added entry in 3 minutes")
	}
}

// TestPausedTicksAreNotCaughtUpAfterResume: a replica that starts after an entry was
// paused and resumed catches up the ticks missed before the pause and after the resume,
// never those of the pause.
func TestPausedTicksAreNotCaughtUpAfterResume(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ctx := testenv.Context(t, time.Minute)
	client := outbox.NewClient(pool, testenv.Redis(t), nil)
	entries := []schedule.Entry{{Name: "p", Schedule: "@every 1s", TaskType: "t"}}
	first, err := schedule.New(pool, client, entries, &schedule.Config{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := first.Tick(ctx); err != nil {
		t.Fatal(err)
	}
	dbNow := func() time.Time {
		var now time.Time
		if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&now); err != nil {
			t.Fatal(err)
		}
		return now
	}
	// The first replica stops; the entry is paused for 3 s, then resumed.
	if err := schedule.Pause(ctx, pool, "p"); err != nil {
		t.Fatal(err)
	}
	pausedBy := dbNow()
	for dbNow().Before(pausedBy.Add(3 * time.Second)) {
		time.Sleep(100 * time.Millisecond)
	}
	resumedFrom := dbNow()
	if err := schedule.Resume(ctx, pool, "p"); err != nil {
		t.Fatal(err)
	}
	later, err := schedule.New(pool, client, nil, &schedule.Config{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := later.Tick(ctx); err != nil {
		t.Fatal(err)
	}
	rows := testenv.Strings(t, pool, `SELECT idempotency_key FROM job_intents ORDER BY 1`)
	for _, k := range rows {
		tick, err := time.Parse(schedule.TickLayout, strings.TrimPrefix(k, "cron:p:"))
		if err != nil {
			t.Fatalf("key %q: %v", k, err)
		}
		if tick.After(pausedBy) && tick.Before(resumedFrom) {
			t.Errorf("%s: a tick of the pause (%s to %s) was caught up", k, pausedBy.UTC().Format(time.RFC3339Nano), resumedFrom.UTC().Format(time.RFC3339Nano))
		}
	}
}

// TestAReplicaWhoseClockRunsAheadEnqueuesNoTickEarly: a replica whose clock reads past
// the next hour while the database's has not reached it enqueues nothing; its tick is
// due by the database's clock, which every replica shares.
func TestAReplicaWhoseClockRunsAheadEnqueuesNoTickEarly(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ctx := testenv.Context(t, time.Minute)
	var dbNow time.Time
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&dbNow); err != nil {
		t.Fatal(err)
	}
	next := dbNow.UTC().Truncate(time.Hour).Add(time.Hour)
	skew := next.Add(5 * time.Second).Sub(dbNow) // up to an hour ahead: 5 s past the next hour
	s, err := schedule.New(pool, outbox.NewClient(pool, testenv.Redis(t), nil),
		[]schedule.Entry{{Name: "hourly", Schedule: "0 * * * *", TaskType: "t"}},
		&schedule.Config{Logger: quiet, Now: func() time.Time { return time.Now().Add(skew) }})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Tick(ctx); err != nil {
		t.Fatal(err)
	}
	if keys := testenv.Strings(t, pool, `SELECT idempotency_key FROM job_intents`); len(keys) != 0 {
		t.Errorf("a replica %v ahead enqueued %q before the database's clock reached %s", skew.Round(time.Second), keys, next.Format(schedule.TickLayout))
	}
}
