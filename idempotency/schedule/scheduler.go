package schedule

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/idempotency/outbox"
)

// Event is what became of a tick, for metrics (Config.Observe).
type Event string

// The events of ticks.
const (
	// EventEnqueued: this replica recorded the tick's job.
	EventEnqueued Event = "enqueued"
	// EventDuplicate: the tick's job was recorded already, by another replica (or by
	// this one before a restart).
	EventDuplicate Event = "duplicate"
	// EventCaughtUp: a tick missed while no replica ran, enqueued (or found) on start;
	// also counted as enqueued or duplicate.
	EventCaughtUp Event = "caught_up"
	// EventSkipped: a tick not enqueued, by design: the entry is paused, the previous
	// tick's job is unfinished (OverlapSkip), or the catch-up policy passes it over.
	EventSkipped Event = "skipped"
	// EventMismatch: the tick's job was recorded with another payload (the entry changed
	// while another replica still ran the old one): refused, logged.
	EventMismatch Event = "mismatch"
)

// Defaults of Config.
const (
	// DefaultRetention is Config.Retention's default: idemq's default ledger retention.
	DefaultRetention = 30 * 24 * time.Hour
	// DefaultPoll is Config.Poll's default.
	DefaultPoll = 5 * time.Second
	// DefaultMaxCatchUp is Config.MaxCatchUp's default.
	DefaultMaxCatchUp = 1000
)

// Config configures a Scheduler; nil or zero fields take the defaults.
type Config struct {
	// Retention is the ledger's retention (how long a completed job's row and intent are
	// kept): every entry's CatchUpWindow must be shorter, or New refuses it, since a
	// catch-up recognises a tick already enqueued by its row. Default DefaultRetention.
	Retention time.Duration
	// Poll is how often Run reads the schedule table between ticks, so that a pause, a
	// resume or another replica's new revision is seen. Default DefaultPoll.
	Poll time.Duration
	// MaxCatchUp bounds the ticks one entry catches up at a start (the newest are kept).
	// Default DefaultMaxCatchUp.
	MaxCatchUp int
	// Now is this replica's clock, by which it waits between rounds (and keys ticks with
	// UnsafeWallClockKeys). Default time.Now. Which ticks are due is judged on the
	// database's clock, not on this one: a replica whose clock runs ahead enqueues no
	// tick before its instant.
	Now func() time.Time
	// DatabaseNow is for TESTS ONLY (a simulated day): it stands in for the database's
	// clock, by which a round judges which ticks are due. Default nil: Postgres's
	// clock_timestamp(), read at the start of each round.
	DatabaseNow func() time.Time
	// Logger gets what is worth knowing (catch-ups, mismatches, errors). Default
	// slog.Default().
	Logger *slog.Logger
	// TaskTypes, when set, are the task types this scheduler may enqueue, each with the
	// check its handler makes of a job's payload (nil: none), given the payload of the
	// entry's next tick and of a manual run (the entry's payload with the tick's fields).
	// New refuses an entry of another type (field task_type) or whose job the check
	// refuses (field payload); a round skips such an entry that another replica wrote to
	// the table, logging why once per revision. Default nil: any task type, unchecked.
	TaskTypes map[string]func(payload []byte) error
	// Observe, when set, is called once per tick and event, with the entry's name.
	Observe func(ev Event, entry string)
	// UnsafeWallClockKeys is for TESTS ONLY (negative control): key each due tick by
	// this replica's clock reading at enqueue, to the second, instead of the scheduled
	// instant, so that replicas whose rounds run at different moments name one tick
	// differently, and ticks caught up together share one key. Default false.
	UnsafeWallClockKeys bool
}

// Scheduler turns the entries of the schedule table (schedule_entries) into jobs: each
// tick of each entry becomes one job, keyed TickKey(entry, tick), recorded through the
// outbox, so that replicas that see the same tick record one intent. Run any number of
// replicas. Safe for concurrent use; Run once per Scheduler.
type Scheduler struct {
	pool    *pgxpool.Pool
	outbox  *outbox.Client
	entries []*plan // to upsert; nil: schedule from the table as it is
	cfg     Config
	log     *slog.Logger

	mu      sync.Mutex
	offset  time.Duration // the database's clock minus this replica's, at the last round
	cursors map[string]*cursor
	refused map[string]int64 // entries of the table refused by TaskTypes, by revision
}

// cursor is what a replica knows of one entry: the revision it compiled, and the instant
// up to which it has handled the entry's ticks.
type cursor struct {
	revision int64
	sum      []byte // the spec's sha256: an entry removed and re-added restarts at revision 1
	plan     *plan
	upTo     time.Time
}

// New returns a Scheduler that records jobs with client, on pool's database (migrated:
// migrations.Up). entries are this replica's schedule, upserted into the table by Sync
// (Run calls it); nil leaves the table as other replicas wrote it. New checks entries
// (Validate) and each CatchUpWindow against cfg.Retention: errors name the entry and
// the field.
func New(pool *pgxpool.Pool, client *outbox.Client, entries []Entry, cfg *Config) (*Scheduler, error) {
	s := &Scheduler{pool: pool, outbox: client, cursors: map[string]*cursor{}, refused: map[string]int64{}}
	if cfg != nil {
		s.cfg = *cfg
	}
	c := &s.cfg
	if c.Retention <= 0 {
		c.Retention = DefaultRetention
	}
	if c.Poll <= 0 {
		c.Poll = DefaultPoll
	}
	if c.MaxCatchUp <= 0 {
		c.MaxCatchUp = DefaultMaxCatchUp
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	s.log = c.Logger
	if s.log == nil {
		s.log = slog.Default()
	}
	if entries != nil {
		plans, err := compileAll(entries)
		if err != nil {
			return nil, err
		}
		var errs []error
		for _, p := range plans {
			if err := s.checkWindow(p); err != nil {
				errs = append(errs, err)
			}
			if err := s.checkTask(p); err != nil {
				errs = append(errs, err)
			}
		}
		if err := errors.Join(errs...); err != nil {
			return nil, err
		}
		s.entries = plans
	}
	return s, nil
}

func (s *Scheduler) checkWindow(p *plan) error {
	if p.CatchUpWindow >= s.cfg.Retention {
		return &EntryError{Entry: fmt.Sprintf("%q", p.Name), Field: "catch_up_window",
			Err: fmt.Errorf("%v must be shorter than the ledger's retention (%v): a tick older than that can no longer be recognised as enqueued", p.CatchUpWindow, s.cfg.Retention)}
	}
	return nil
}

// checkTask checks p against Config.TaskTypes: its task type is one of them, and the
// jobs of its next tick and of a manual run pass the type's check.
func (s *Scheduler) checkTask(p *plan) error {
	if s.cfg.TaskTypes == nil {
		return nil
	}
	bad := func(field string, err error) error {
		return &EntryError{Entry: fmt.Sprintf("%q", p.Name), Field: field, Err: err}
	}
	check, ok := s.cfg.TaskTypes[p.TaskType]
	if !ok {
		known := make([]string, 0, len(s.cfg.TaskTypes))
		for t := range s.cfg.TaskTypes {
			known = append(known, t)
		}
		slices.Sort(known)
		return bad("task_type", fmt.Errorf("%q is not a task type this scheduler enqueues (%s)", p.TaskType, strings.Join(known, ", ")))
	}
	if check == nil {
		return nil
	}
	at := p.sched.Next(s.cfg.Now())
	if at.IsZero() {
		at = s.cfg.Now()
	}
	at = at.UTC().Truncate(time.Second)
	for _, t := range []Tick{{Entry: p.Name, At: at}, {Entry: p.Name, At: at, Manual: "check"}} {
		if err := check(t.payload(p.Payload)); err != nil {
			return bad("payload", fmt.Errorf("its task %s refuses a tick's job: %w", p.TaskType, err))
		}
	}
	return nil
}

// Sync makes the schedule table hold this replica's entries: new ones are added, changed
// ones get a new revision (which applies from their first tick after it), unchanged ones
// keep theirs (and their pause), and entries no longer given are deleted, so they
// enqueue nothing more. It does nothing when New was given nil entries.
func (s *Scheduler) Sync(ctx context.Context) error {
	if s.entries == nil {
		return nil
	}
	params := make([]store.ScheduleEntryParams, len(s.entries))
	for i, p := range s.entries {
		b, err := json.Marshal(p.Entry)
		if err != nil {
			return fmt.Errorf("schedule: entry %q: %w", p.Name, err)
		}
		sum := sha256.Sum256(b)
		params[i] = store.ScheduleEntryParams{Name: p.Name, Spec: b, Sum: sum[:]}
	}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error { return store.UpsertSchedule(ctx, tx, params) })
	if err != nil {
		return fmt.Errorf("schedule: sync the schedule table: %w", err)
	}
	return nil
}

// Run syncs this replica's entries (Sync), then enqueues every tick as it comes, and the
// ticks missed while no replica ran (each entry's CatchUp policy), until ctx ends. It
// reads the table at each tick and every Config.Poll. A failed round (Postgres out of
// reach) is logged and tried again after a wait that doubles from 100 ms to 5 s: the
// ticks it missed are enqueued late, not lost.
// A Sync that fails (Postgres out of reach) is logged and tried again every Config.Poll:
// until it succeeds, this replica schedules nothing. It returns nil when ctx ends.
func (s *Scheduler) Run(ctx context.Context) error {
	for {
		err := s.Sync(ctx)
		if err == nil {
			break
		}
		s.log.WarnContext(ctx, "schedule: cannot sync this replica's entries; trying again", "err", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(s.cfg.Poll):
		}
	}
	var backoff time.Duration
	for {
		var wait time.Duration
		if _, err := s.Tick(ctx); err != nil && ctx.Err() == nil {
			// The failed round's ticks are due still: wait a growing while, as the relay
			// does, rather than the 10 ms before a due tick.
			backoff = min(max(2*backoff, 100*time.Millisecond), 5*time.Second)
			wait = backoff
			s.log.WarnContext(ctx, "schedule: round failed; trying again", "err", err, "retry_in", backoff)
		} else {
			backoff = 0
			wait = s.cfg.Poll
			if n, ok := s.nextTick(); ok {
				wait = min(wait, max(n.Sub(s.dbNowEstimate()), 10*time.Millisecond))
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
}

// nextTick is the earliest tick not yet handled, among the entries this replica knows.
func (s *Scheduler) nextTick() (time.Time, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var first time.Time
	for _, c := range s.cursors {
		if n := c.plan.sched.Next(c.upTo); !n.IsZero() && (first.IsZero() || n.Before(first)) {
			first = n
		}
	}
	return first, !first.IsZero()
}

// dbNowEstimate is the database's clock as this replica's reads it, by the offset
// between the two measured at the last round.
func (s *Scheduler) dbNowEstimate() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cfg.Now().Add(s.offset)
}

// dbNow reads the database's clock (Config.DatabaseNow in tests).
func (s *Scheduler) dbNow(ctx context.Context) (time.Time, error) {
	if s.cfg.DatabaseNow != nil {
		return s.cfg.DatabaseNow(), nil
	}
	return store.DatabaseNow(ctx, s.pool)
}

// TickStats counts what one round did, over all entries.
type TickStats struct {
	Enqueued, Duplicate, CaughtUp, Skipped, Mismatch int
}

// Tick is one round at the database's clock (Config.DatabaseNow in tests): it reads the schedule table and, for each entry,
// enqueues the ticks due since this replica last handled it (on its first look at an
// entry: the missed ticks its CatchUp policy keeps, within its window, after the newest
// tick any replica enqueued). Run calls it; tests call it with an injected clock.
func (s *Scheduler) Tick(ctx context.Context) (TickStats, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var st TickStats
	// Due is judged on the database's clock: every replica reads the same one, and a
	// replica whose own clock runs ahead enqueues nothing early.
	now, err := s.dbNow(ctx)
	if err != nil {
		return st, fmt.Errorf("schedule: read the database's clock: %w", err)
	}
	s.offset = now.Sub(s.cfg.Now())
	rows, err := store.ReadSchedule(ctx, s.pool)
	if err != nil {
		return st, fmt.Errorf("schedule: read the schedule table: %w", err)
	}
	seen := make(map[string]bool, len(rows))
	var errs []error
	for _, r := range rows {
		seen[r.Name] = true
		if err := s.entryRound(ctx, r, now, &st); err != nil {
			errs = append(errs, err)
		}
	}
	for name := range s.cursors {
		if !seen[name] {
			delete(s.cursors, name) // removed from the schedule: nothing more
		}
	}
	return st, errors.Join(errs...)
}

// entryRound handles entry r's due ticks at now.
func (s *Scheduler) entryRound(ctx context.Context, r store.ScheduleEntryRow, now time.Time, st *TickStats) error {
	c, known := s.cursors[r.Name]
	var due []time.Time
	catchUp := false
	switch {
	case !known || c.revision != r.Revision || !bytes.Equal(c.sum, r.Sum):
		p, err := readPlan(r)
		if err != nil {
			return err
		}
		if err := s.checkTask(p); err != nil {
			// Another replica's entry that this one's task types refuse: skipped, said once
			// per revision.
			if s.refused[r.Name] != r.Revision {
				s.refused[r.Name] = r.Revision
				s.log.ErrorContext(ctx, "schedule: an entry of the table is refused; its ticks are not enqueued", "entry", r.Name, "revision", r.Revision, "err", err)
			}
			delete(s.cursors, r.Name)
			return nil
		}
		delete(s.refused, r.Name)
		if !known {
			// A first look: the ticks missed since the newest any replica enqueued, within
			// the window and after the entry's revision, by the catch-up policy.
			from := latest(now.Add(-p.CatchUpWindow), r.RevisedAt)
			if r.LastTick.Valid {
				from = latest(from, r.LastTick.Time)
			}
			all := p.ticks(from, now, s.cfg.MaxCatchUp)
			switch p.CatchUp {
			case CatchUpAll:
				due = all
			case CatchUpLatest:
				if len(all) > 0 {
					due = all[len(all)-1:]
				}
			}
			if skipped := len(all) - len(due); skipped > 0 {
				s.count(EventSkipped, r.Name, skipped, &st.Skipped)
			}
			catchUp = len(due) > 0
			c = &cursor{}
			s.cursors[r.Name] = c
		} else {
			// A new revision applies from its first tick after it.
			due = p.ticks(latest(c.upTo, r.RevisedAt), now, s.cfg.MaxCatchUp)
		}
		c.revision, c.sum, c.plan = r.Revision, r.Sum, p
	default:
		due = c.plan.ticks(c.upTo, now, s.cfg.MaxCatchUp)
	}
	if n := len(due); n > 0 {
		// The ticks of the entry's last pause are skipped, by whoever sees them late.
		due = slices.DeleteFunc(due, func(t time.Time) bool { return inPause(r, t) })
		if skipped := n - len(due); skipped > 0 {
			s.count(EventSkipped, r.Name, skipped, &st.Skipped)
		}
		catchUp = catchUp && len(due) > 0
	}
	switch {
	case len(due) == 0:
	case r.Paused:
		s.count(EventSkipped, r.Name, len(due), &st.Skipped)
		due = nil
	case c.plan.Overlap == OverlapSkip:
		if r.LastState.Valid && (r.LastState.String == outbox.IntentPending || r.LastState.String == outbox.IntentPublished) {
			s.count(EventSkipped, r.Name, len(due), &st.Skipped)
			due = nil
		} else if len(due) > 1 {
			// One job at a time: the newest tick, the others skipped.
			s.count(EventSkipped, r.Name, len(due)-1, &st.Skipped)
			due = due[len(due)-1:]
		}
	}
	if len(due) > 0 {
		if err := s.enqueue(ctx, c.plan, due, catchUp, st); err != nil {
			return err // c.upTo stays: the next round tries these ticks again
		}
	}
	c.upTo = latest(c.upTo, now)
	return nil
}

// inPause reports whether tick t fell in entry r's last pause, [paused_at, resumed_at]
// (before resumed_at when the pause was made by a build that did not record paused_at).
func inPause(r store.ScheduleEntryRow, t time.Time) bool {
	if !r.ResumedAt.Valid || t.After(r.ResumedAt.Time) {
		return false
	}
	if r.PausedAt.Valid && r.PausedAt.Time.After(r.ResumedAt.Time) {
		return false // paused again since, and resumed by a build that does not record it
	}
	return !r.PausedAt.Valid || !t.Before(r.PausedAt.Time)
}

// enqueue records the jobs of p's ticks in one transaction, with the newest as the
// entry's last tick, then wakes the relays.
func (s *Scheduler) enqueue(ctx context.Context, p *plan, ticks []time.Time, catchUp bool, st *TickStats) error {
	if s.cfg.UnsafeWallClockKeys {
		ticks = s.wallClockTicks(ticks)
	}
	specs := make([]outbox.Spec, len(ticks))
	for i, t := range ticks {
		specs[i] = p.spec(Tick{Entry: p.Name, At: t})
	}
	var results []outbox.EnqueueResult
	var specErrs []error
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var err error
		if results, specErrs, err = s.outbox.EnqueueManyTx(ctx, tx, specs, false); err != nil {
			return err
		}
		last := len(ticks) - 1
		return store.AdvanceSchedule(ctx, tx, p.Name, ticks[last], specs[last].Key)
	})
	if err != nil {
		return fmt.Errorf("schedule: entry %q: enqueue %d ticks: %w", p.Name, len(ticks), err)
	}
	s.outbox.Wake(ctx)
	for i, res := range results {
		var mm *idempotency.MismatchError
		switch {
		case errors.As(specErrs[i], &mm):
			s.count(EventMismatch, p.Name, 1, &st.Mismatch)
			s.log.ErrorContext(ctx, "schedule: a tick's job was recorded with another payload: the entry changed while a replica ran the old one",
				"entry", p.Name, "key", specs[i].Key)
		case specErrs[i] != nil:
			s.log.ErrorContext(ctx, "schedule: a tick's job was refused", "entry", p.Name, "key", specs[i].Key, "err", specErrs[i])
		case res.Duplicate:
			s.count(EventDuplicate, p.Name, 1, &st.Duplicate)
		default:
			s.count(EventEnqueued, p.Name, 1, &st.Enqueued)
		}
		if catchUp && specErrs[i] == nil {
			s.count(EventCaughtUp, p.Name, 1, &st.CaughtUp)
		}
	}
	if catchUp {
		s.log.InfoContext(ctx, "schedule: caught up missed ticks", "entry", p.Name, "ticks", len(ticks),
			"first", ticks[0].Format(TickLayout), "last", ticks[len(ticks)-1].Format(TickLayout))
	}
	return nil
}

// wallClockTicks is Config.UnsafeWallClockKeys: every due tick becomes this replica's
// clock reading, to the second; the ticks so named alike are one.
func (s *Scheduler) wallClockTicks(ticks []time.Time) []time.Time {
	at := s.cfg.Now().UTC().Truncate(time.Second)
	for i := range ticks {
		ticks[i] = at
	}
	return ticks[:1]
}

func (s *Scheduler) count(ev Event, entry string, n int, total *int) {
	*total += n
	if s.cfg.Observe != nil {
		for range n {
			s.cfg.Observe(ev, entry)
		}
	}
}

// spec is the Spec of p's job for t: the entry's payload with t's fields added.
func (p *plan) spec(t Tick) outbox.Spec {
	return outbox.Spec{Key: t.Key(), Type: p.TaskType, Payload: t.payload(p.Payload), Queue: p.Queue,
		MaxRetry: p.MaxRetry, Timeout: p.Timeout}
}

func latest(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
