package idempotency

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency/internal/store"
)

// Lease states Filter.Lease selects among in-progress rows, on the database clock.
const (
	LeaseLive   = store.LeaseLive   // locked_until is still ahead: a worker holds the key
	LeaseLapsed = store.LeaseLapsed // locked_until has passed: the next delivery takes the key over
)

// Filter selects ledger rows for Find; the zero value of a field does not filter.
type Filter struct {
	Status        string        // one of the Status* constants
	TaskType      string        // exactly this task type
	StartedWithin time.Duration // started (claimed, or re-run) at most this long ago
	StartedBefore time.Duration // started more than this long ago
	Lease         string        // LeaseLive or LeaseLapsed: in-progress rows only
	HasDuplicates bool          // rows whose key has a recorded "duplicate" event
	Limit         int           // at most this many rows (required, > 0)
}

// Find returns up to f.Limit rows matching f, the most recently started first. It reads
// through the started_at index, so a small limit or an age filter stays cheap on a big
// ledger; a filter on status, type or lease alone may scan further to fill the limit. It
// is meant for operators. Errors wrap ErrInvalidRequest for a bad filter. Safe for
// concurrent use.
func (l *Ledger) Find(ctx context.Context, f Filter) ([]Record, error) {
	switch f.Status {
	case "", StatusInProgress, StatusCompleted, StatusFailed, StatusNeedsAttention:
	default:
		return nil, unknownStatus(f.Status)
	}
	switch f.Lease {
	case "", LeaseLive, LeaseLapsed:
	default:
		return nil, fmt.Errorf("%w: unknown lease state %q", ErrInvalidRequest, f.Lease)
	}
	if f.Limit <= 0 || f.StartedWithin < 0 || f.StartedBefore < 0 {
		return nil, fmt.Errorf("%w: find: limit %d, ages %v and %v", ErrInvalidRequest, f.Limit, f.StartedWithin, f.StartedBefore)
	}
	sql, args := store.FindSQL(store.FindParams(f))
	rows, err := l.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("idempotency: find: %w", err)
	}
	recs, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Record, error) { return scanRecord(row) })
	if err != nil {
		return nil, fmt.Errorf("idempotency: find: %w", err)
	}
	return recs, nil
}

// Counts are the ledger's outcomes over a window: the rows started in it (claimed, or
// re-run) by where they are now, and the events recorded in it by kind.
type Counts struct {
	Window         time.Duration
	Completed      int64
	Failed         int64
	NeedsAttention int64
	Live           int64            // in progress under a running lease
	Lapsed         int64            // in progress, lease ended: waiting for a takeover
	Events         map[string]int64 // by kind ("duplicate", "takeover", ...)
}

// Count returns the Counts over the last window, on the database clock, in one statement
// that reads the started_at index of processed_jobs and the at index of
// processed_job_events. Safe for concurrent use.
func (l *Ledger) Count(ctx context.Context, window time.Duration) (Counts, error) {
	c := Counts{Window: window, Events: map[string]int64{}}
	if window <= 0 {
		return c, fmt.Errorf("%w: count: window %v", ErrInvalidRequest, window)
	}
	rows, err := l.pool.Query(ctx, store.CountsSQL, window.Seconds())
	if err != nil {
		return c, fmt.Errorf("idempotency: count: %w", err)
	}
	var (
		what, name string
		live       bool
		n          int64
	)
	_, err = pgx.ForEachRow(rows, []any{&what, &name, &live, &n}, func() error {
		switch {
		case what == "event":
			c.Events[name] += n
		case name == StatusCompleted:
			c.Completed += n
		case name == StatusFailed:
			c.Failed += n
		case name == StatusNeedsAttention:
			c.NeedsAttention += n
		case name == StatusInProgress && live:
			c.Live += n
		case name == StatusInProgress:
			c.Lapsed += n
		}
		return nil
	})
	if err != nil {
		return c, fmt.Errorf("idempotency: count: %w", err)
	}
	return c, nil
}
