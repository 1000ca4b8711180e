package idempotency

import (
	"context"
	"fmt"
	"time"

	"github.com/idemq/idemq/idempotency/internal/store"
)

// historyDaysAhead is how many days after today the retention round keeps history
// partitions ready for: events written while no round runs (no replica holds the purge's
// turn) still find theirs for a week.
const historyDaysAhead = 7

// historyDropWait bounds how long a retention round waits to detach one day: a detach
// waits for every transaction that may still read the partition, and an idle session
// left in a transaction would otherwise hold the round, and the rows' purge after it,
// forever. Cut short, the detach is left pending and finished by a later round.
var historyDropWait = 30 * time.Second

// purgeHistory keeps keys' histories (processed_job_events, partitioned by day) within the
// window: readyHistory, then dropHistory. An event therefore outlives its key's row by at
// most a day and a retention round when it was written as its key completed, and by as
// long again as it was written after that (a late duplicate). It returns the estimated
// rows dropped.
func (l *Ledger) purgeHistory(ctx context.Context, now time.Time, olderThan time.Duration) (int64, error) {
	if err := l.readyHistory(ctx, now); err != nil {
		return 0, err
	}
	return l.dropHistory(ctx, now, olderThan)
}

// readyHistory adds the partitions of the days up to historyDaysAhead after now's.
func (l *Ledger) readyHistory(ctx context.Context, now time.Time) error {
	if _, err := store.AddEventDays(ctx, l.pool, now, historyDaysAhead); err != nil {
		return fmt.Errorf("add history partitions: %w", err)
	}
	return nil
}

// dropHistory drops, whole, each partition whose range ended more than olderThan before
// now, oldest first, each within historyDropWait, reporting each to Config.ObservePurge
// (PurgeEvents, with the rows its statistics estimate), and returns the rows dropped.
func (l *Ledger) dropHistory(ctx context.Context, now time.Time, olderThan time.Duration) (int64, error) {
	days, err := store.EventDays(ctx, l.pool)
	if err != nil {
		return 0, fmt.Errorf("list history partitions: %w", err)
	}
	var rows int64
	for _, d := range days {
		if d.Upper.After(now.Add(-olderThan)) {
			break
		}
		began := time.Now()
		dropCtx, cancel := context.WithTimeout(ctx, historyDropWait)
		err := store.DropEventDay(dropCtx, l.pool, d)
		cancel()
		if err != nil {
			return rows, err
		}
		if l.cfg.ObservePurge != nil {
			l.cfg.ObservePurge(PurgeEvents, d.Rows, time.Since(began))
		}
		l.log.Info("idempotency: dropped a day of keys' histories", "partition", d.Name, "ended", d.Upper, "estimated_rows", d.Rows)
		rows += d.Rows
	}
	return rows, nil
}
