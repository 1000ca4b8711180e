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

// UpsertScheduleSQL writes the entries and deletes the rows of entries not among them
// (upsert_schedule.sql).
var UpsertScheduleSQL = sqlText("upsert_schedule", nil)

// UpsertSchedule makes the table hold exactly entries (see UpsertScheduleSQL).
func UpsertSchedule(ctx context.Context, tx pgx.Tx, entries []ScheduleEntryParams) error {
	names, specs, sums := make([]string, len(entries)), make([]string, len(entries)), make([][]byte, len(entries))
	for i, e := range entries {
		names[i], specs[i], sums[i] = e.Name, string(e.Spec), e.Sum
	}
	_, err := tx.Exec(ctx, UpsertScheduleSQL, names, specs, sums)
	return err
}

// ReadScheduleSQL reads every entry with the outbox state of its last tick's job
// (read_schedule.sql).
var ReadScheduleSQL = sqlText("read_schedule", nil)

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

// AdvanceScheduleSQL records an entry's tick as its last when it is newer than the one
// recorded (advance_schedule.sql).
var AdvanceScheduleSQL = sqlText("advance_schedule", nil)

// AdvanceSchedule records tick of entry name, whose job is key, as its last if newer.
func AdvanceSchedule(ctx context.Context, tx pgx.Tx, name string, tick time.Time, key string) error {
	_, err := tx.Exec(ctx, AdvanceScheduleSQL, name, tick, key)
	return err
}

// PauseScheduleSQL pauses or resumes an entry (pause_schedule.sql).
var PauseScheduleSQL = sqlText("pause_schedule", nil)

// PauseSchedule pauses or resumes entry name: false when there is no such entry.
func PauseSchedule(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, name string, paused bool) (bool, error) {
	tag, err := q.Exec(ctx, PauseScheduleSQL, name, paused)
	return tag.RowsAffected() == 1, err
}

// DatabaseNowSQL reads the database's clock (database_now.sql).
var DatabaseNowSQL = sqlText("database_now", nil)

// DatabaseNow returns the database's clock, by which schedulers judge a tick due.
func DatabaseNow(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (time.Time, error) {
	var now time.Time
	err := q.QueryRow(ctx, DatabaseNowSQL).Scan(&now)
	return now, err
}
