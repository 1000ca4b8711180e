package store

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// The periodic schedule (schedule_entries): one row per entry, from which every scheduler
// replica works.

// ScheduleEntryParams is an entry as a replica upserts it: its name, its spec (JSON) and
// the spec's sha256, which tells whether it changed.
type ScheduleEntryParams struct {
	Name string
	Spec []byte
	Sum  []byte
}

// ScheduleEntryRow is an entry as the table holds it.
type ScheduleEntryRow struct {
	Name      string
	Revision  int64
	Spec      []byte
	Sum       []byte // spec_sha256: tells an entry re-added under a revision it had before
	Paused    bool
	RevisedAt time.Time
	// PausedAt and ResumedAt bound the entry's last pause (migration 00111); ResumedAt is
	// not valid while it was never resumed.
	PausedAt  pgtype.Timestamptz
	ResumedAt pgtype.Timestamptz
	LastTick  pgtype.Timestamptz
	LastKey   pgtype.Text
	// LastState is the outbox state of LastKey's intent (pending, published, done, dead),
	// not valid when there is none.
	LastState pgtype.Text
}

// UpsertScheduleSQL writes entries ($1 names, $2 specs, $3 sums) and deletes the rows of
// entries not among them: a new entry starts at revision 1, a changed one gets the next
// revision and a new revised_at, an unchanged one is left as it is (paused or not).
const UpsertScheduleSQL = `
WITH e AS (
	SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[]) AS e(name, spec, sum)
), gone AS (
	DELETE FROM schedule_entries WHERE name <> ALL ($1::text[])
)
INSERT INTO schedule_entries AS s (name, spec, spec_sha256)
SELECT name, spec::jsonb, sum FROM e
ON CONFLICT (name) DO UPDATE
SET spec = excluded.spec, spec_sha256 = excluded.spec_sha256, revision = s.revision + 1,
    revised_at = now(), updated_at = now()
WHERE s.spec_sha256 <> excluded.spec_sha256`

// UpsertSchedule makes the table hold exactly entries (see UpsertScheduleSQL).
func UpsertSchedule(ctx context.Context, tx pgx.Tx, entries []ScheduleEntryParams) error {
	names, specs, sums := make([]string, len(entries)), make([]string, len(entries)), make([][]byte, len(entries))
	for i, e := range entries {
		names[i], specs[i], sums[i] = e.Name, string(e.Spec), e.Sum
	}
	_, err := tx.Exec(ctx, UpsertScheduleSQL, names, specs, sums)
	return err
}

// ReadScheduleSQL reads every entry with the outbox state of its last tick's job.
const ReadScheduleSQL = `
SELECT s.name, s.revision, s.spec::text, s.spec_sha256, s.paused, s.revised_at, s.paused_at, s.resumed_at, s.last_tick, s.last_key, i.state
FROM schedule_entries s LEFT JOIN job_intents i ON i.idempotency_key = s.last_key
ORDER BY s.name`

// ReadSchedule returns every entry, by name.
func ReadSchedule(ctx context.Context, q querier) ([]ScheduleEntryRow, error) {
	rows, err := q.Query(ctx, ReadScheduleSQL)
	if err != nil {
		return nil, err
	}
	var out []ScheduleEntryRow
	var r ScheduleEntryRow
	var spec string
	_, err = pgx.ForEachRow(rows, []any{&r.Name, &r.Revision, &spec, &r.Sum, &r.Paused, &r.RevisedAt, &r.PausedAt, &r.ResumedAt, &r.LastTick, &r.LastKey, &r.LastState}, func() error {
		r.Spec = []byte(spec)
		out = append(out, r)
		r = ScheduleEntryRow{}
		return nil
	})
	return out, err
}

// AdvanceScheduleSQL records tick $2 of entry $1, whose job is $3, as its last when it is
// newer than the one recorded.
const AdvanceScheduleSQL = `
UPDATE schedule_entries SET last_tick = $2, last_key = $3, updated_at = now()
WHERE name = $1 AND (last_tick IS NULL OR last_tick < $2)`

// AdvanceSchedule records tick of entry name, whose job is key, as its last if newer.
func AdvanceSchedule(ctx context.Context, tx pgx.Tx, name string, tick time.Time, key string) error {
	_, err := tx.Exec(ctx, AdvanceScheduleSQL, name, tick, key)
	return err
}

// PauseScheduleSQL pauses ($2 true) or resumes entry $1, recording when an active entry
// was paused and when a paused one was resumed; it reports whether it exists.
const PauseScheduleSQL = `
UPDATE schedule_entries SET paused = $2, updated_at = now(),
    paused_at = CASE WHEN $2 AND NOT paused THEN now() ELSE paused_at END,
    resumed_at = CASE WHEN NOT $2 AND paused THEN now() ELSE resumed_at END
WHERE name = $1`

// PauseSchedule pauses or resumes entry name: false when there is no such entry.
func PauseSchedule(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, name string, paused bool) (bool, error) {
	tag, err := q.Exec(ctx, PauseScheduleSQL, name, paused)
	return tag.RowsAffected() == 1, err
}

// DatabaseNowSQL reads the database's clock.
const DatabaseNowSQL = `SELECT clock_timestamp()`

// DatabaseNow returns the database's clock, by which schedulers judge a tick due.
func DatabaseNow(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (time.Time, error) {
	var now time.Time
	err := q.QueryRow(ctx, DatabaseNowSQL).Scan(&now)
	return now, err
}
