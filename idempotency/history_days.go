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

// purgeHistory keeps keys' histories (processed_job_events, partitioned by day) within the
// window: it adds the partitions of the coming days and drops, whole, each partition whose
// range ended more than olderThan ago, reporting each to Config.ObservePurge (PurgeEvents,
// with the rows its statistics estimate). An event therefore outlives its key's row by
// at most a day and a retention round when it was written as its key completed, and by
// as long again as it was written after that (a late duplicate). It returns the estimated
// rows dropped.
func (l *Ledger) purgeHistory(ctx context.Context, now time.Time, olderThan time.Duration) (int64, error) {
	if _, err := store.AddEventDays(ctx, l.pool, now, historyDaysAhead); err != nil {
		return 0, fmt.Errorf("add history partitions: %w", err)
	}
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
		if err := store.DropEventDay(ctx, l.pool, d); err != nil {
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
