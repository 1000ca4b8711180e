package store

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// FinishArgs returns FinishMany's arguments for ps.
func FinishArgs(ps []FinishParams) []any {
	keys, fences, owners := make([]string, len(ps)), make([]int64, len(ps)), make([]pgtype.UUID, len(ps))
	actions, results, errs := make([]string, len(ps)), make([]pgtype.Text, len(ps)), make([]pgtype.Text, len(ps))
	sums := make([][]byte, len(ps))
	for i, p := range ps {
		keys[i], fences[i], owners[i], actions[i], results[i], errs[i] = p.Key, p.Fence, p.Owner, string(p.Action), p.Result, p.Error
		sums[i] = p.IntentSum
	}
	return []any{keys, fences, owners, actions, results, errs, sums}
}

// ScanFinished reads an answered row of FinishMany (in a Round: its ordinal is read).
func ScanFinished(rows pgx.Rows, f *Finished) error {
	return rows.Scan(nil, &f.XID, &f.ServerStart, nil)
}

// LeaseParams is one claim's lease to extend (ExtendLeases).
type LeaseParams struct {
	Key   string
	Fence int64
	Owner pgtype.UUID
	Lease time.Duration
}

// ExtendLeases extends the leases of ps in one statement on q, in the order of ps (sort
// them by key). held[i] reports whether ps[i]'s claim still holds its key.
func (w *Writes) ExtendLeases(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, ps []LeaseParams) (held []bool, err error) {
	keys, fences, owners, leases := make([]string, len(ps)), make([]int64, len(ps)), make([]pgtype.UUID, len(ps)), make([]int64, len(ps))
	for i, p := range ps {
		keys[i], fences[i], owners[i], leases[i] = p.Key, p.Fence, p.Owner, p.Lease.Microseconds()
	}
	rows, err := q.Query(ctx, w.HeartbeatMany, keys, fences, owners, leases)
	if err != nil {
		return nil, err
	}
	held = make([]bool, len(ps))
	var ord int64
	_, err = pgx.ForEachRow(rows, []any{&ord}, func() error {
		held[ord-1] = true
		return nil
	})
	if err != nil {
		return nil, err
	}
	return held, nil
}

// ExtendLease extends a claim's lease by lease from now, never shortening it, on q. It
// reports false when the claim no longer holds the key.
func (w *Writes) ExtendLease(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, key string, fence int64, owner pgtype.UUID, lease time.Duration) (until time.Time, held bool, err error) {
	err = q.QueryRow(ctx, w.Heartbeat, key, fence, owner, lease.Microseconds()).Scan(&until)
	if err == pgx.ErrNoRows {
		return time.Time{}, false, nil
	}
	return until, err == nil, err
}
