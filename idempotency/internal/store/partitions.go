package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// EventDaysSQL lists the partitions of processed_job_events (event_days.sql).
var EventDaysSQL = sqlText("event_days", nil)

// EventsTable is the history table, partitioned by day on its `at` column.
const EventsTable = "processed_job_events"

// An EventDay is one partition of EventsTable: the events of [.., Upper).
type EventDay struct {
	Name          string
	Upper         time.Time
	DetachPending bool  // a concurrent detach was cut short: it is finished before the drop
	Rows          int64 // estimated from its statistics; 0 when never analyzed
}

// EventDays lists EventsTable's partitions, oldest first; none when it is not
// partitioned (a schema before 00114).
func EventDays(ctx context.Context, pool *pgxpool.Pool) ([]EventDay, error) {
	rows, err := pool.Query(ctx, EventDaysSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (EventDay, error) {
		var d EventDay
		err := r.Scan(&d.Name, &d.Upper, &d.DetachPending, &d.Rows)
		d.Rows = max(d.Rows, 0)
		return d, err
	})
}

// AddEventDays makes sure EventsTable has partitions up to the end of the day `ahead`
// after now's (UTC), each a day long (the first one longer, from where the last one ends
// up to tomorrow, when the last one ended before today), and returns how many it added.
// Each is created on its own and then attached, which takes a SHARE UPDATE EXCLUSIVE lock
// on EventsTable: inserts go on meanwhile. Callers are serialised by a transaction-level
// advisory lock, under which the partitions are listed again.
func AddEventDays(ctx context.Context, pool *pgxpool.Pool, now time.Time, ahead int) (int, error) {
	added := 0
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '5s'`); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.processed_job_events partitions'))`); err != nil {
			return err
		}
		var last *time.Time
		if err := tx.QueryRow(ctx, `SELECT max(upper) FROM (`+EventDaysSQL+`) d`).Scan(&last); err != nil {
			return fmt.Errorf("read its partitions: %w", err)
		}
		if last == nil {
			return nil // not partitioned
		}
		today := now.UTC().Truncate(24 * time.Hour)
		end := today.AddDate(0, 0, ahead+1)
		for lo := last.UTC(); lo.Before(end); {
			hi := lo.AddDate(0, 0, 1)
			if hi.Before(today.AddDate(0, 0, 1)) {
				hi = today.AddDate(0, 0, 1)
			}
			name := pgx.Identifier{EventsTable + "_p" + lo.Format("20060102")}.Sanitize()
			if _, err := tx.Exec(ctx, `CREATE TABLE `+name+` (LIKE `+EventsTable+` INCLUDING DEFAULTS INCLUDING CONSTRAINTS)`); err != nil {
				return fmt.Errorf("create %s: %w", name, err)
			}
			if _, err := tx.Exec(ctx, fmt.Sprintf(`ALTER TABLE %s ATTACH PARTITION %s FOR VALUES FROM ('%s') TO ('%s')`,
				EventsTable, name, lo.Format(time.RFC3339), hi.Format(time.RFC3339))); err != nil {
				return fmt.Errorf("attach %s: %w", name, err)
			}
			added++
			lo = hi
		}
		return nil
	})
	return added, err
}

// DropEventDay detaches day from EventsTable concurrently (a SHARE UPDATE EXCLUSIVE lock:
// inserts and reads go on) and drops it. A detach cut short earlier is finished instead.
// A detach waits for the transactions that may still read the partition; cut short by
// ctx, it is left pending for the next call.
func DropEventDay(ctx context.Context, pool *pgxpool.Pool, day EventDay) error {
	name := pgx.Identifier{day.Name}.Sanitize()
	mode := "CONCURRENTLY"
	if day.DetachPending {
		mode = "FINALIZE"
	}
	if _, err := pool.Exec(ctx, `ALTER TABLE `+EventsTable+` DETACH PARTITION `+name+` `+mode); err != nil {
		return fmt.Errorf("detach %s: %w", name, err)
	}
	if _, err := pool.Exec(ctx, `DROP TABLE `+name); err != nil {
		return fmt.Errorf("drop %s: %w", name, err)
	}
	return nil
}
