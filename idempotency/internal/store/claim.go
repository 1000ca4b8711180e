package store

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// ClaimMany is the claim statement (claim_many.sql).
var ClaimMany = &Statement{Name: "idemq_claim_many", SQL: sqlText("claim_many", nil)}

// ClaimArgs returns ClaimMany's arguments for ps.
func ClaimArgs(ps []ClaimParams, maxAge time.Duration) []any {
	keys, types := make([]string, len(ps)), make([]string, len(ps))
	owners, fps, leases := make([]pgtype.UUID, len(ps)), make([][]byte, len(ps)), make([]int64, len(ps))
	traces := make([]pgtype.Text, len(ps))
	for i, p := range ps {
		keys[i], types[i], owners[i], fps[i], leases[i] = p.Key, p.TaskType, p.Owner, p.Fingerprint, p.Lease.Microseconds()
		traces[i] = pgtype.Text{String: p.TraceID, Valid: p.TraceID != ""}
	}
	return []any{keys, types, owners, fps, leases, maxAge.Microseconds(), traces}
}

// ScanClaim reads an answered row of ClaimMany (in a Round: its ordinal is read) into r.
func ScanClaim(rows pgx.Rows, r *ClaimRow) error { return rows.Scan(r.targets(nil)...) }

var (
	readRowSQL      = sqlText("read_row", nil)       // a row for a claim that lost a race
	markStuckOneSQL = sqlText("mark_stuck_one", nil) // one claim into needs_attention
)

// ReadRow reads key's row for a claim that lost a race, with a fresh snapshot. A row
// that is gone reads as none (Status not valid).
func ReadRow(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, key string, r *ClaimRow) error {
	err := q.QueryRow(ctx, readRowSQL, key).Scan(r.targets()...)
	if err == pgx.ErrNoRows {
		*r = ClaimRow{}
		return nil
	}
	return err
}

// MarkStuckOne turns key's claim fence, expired and too old, into needs_attention.
func MarkStuckOne(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, key string, fence int64) error {
	_, err := q.Exec(ctx, markStuckOneSQL, key, fence)
	return err
}

// claimSettingsSQL is the claims' settings: the plans of the multi-row statements and
// the bound on their row-lock waits (claim_settings.sql).
var claimSettingsSQL = sqlText("claim_settings", nil)
