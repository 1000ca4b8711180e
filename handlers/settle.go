package handlers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/tasks"
)

// SettleResult is what a completed wallet:settle records: the settlement row it wrote.
type SettleResult struct {
	SettlementID int64     `json:"settlement_id"`
	PeriodStart  time.Time `json:"period_start"`
	PeriodEnd    time.Time `json:"period_end"`
	Entries      int64     `json:"entries"`
	TotalCents   int64     `json:"total_cents"`
}

// SettleLateness is how long before its period a wallet entry may be stamped and still
// be settled by a later period's settlement: how long a debit's transaction may stay
// open between its insert (which stamps created_at) and its commit.
const SettleLateness = time.Hour

// insertSettlement claims, for scope $5, the entries stamped up to the period's end ($3)
// that no settlement of the scope has summed (those of the period, and those of earlier
// periods whose transactions committed after their settlement ran, back to $6 before the
// period, once the scope has settled anything), and writes one row summing them.
const insertSettlement = `
WITH s AS (
	SELECT nextval(pg_get_serial_sequence('wallet_settlements', 'id')) AS id
), claimed AS (
	INSERT INTO wallet_settled_entries (scope, entry_id, settlement_id)
	SELECT $5, w.id, (SELECT id FROM s) FROM wallet_entries w
	WHERE w.created_at <= $3
	  AND w.created_at > CASE WHEN EXISTS (SELECT 1 FROM wallet_settled_entries x WHERE x.scope = $5)
	                          THEN $2::timestamptz - $6::interval ELSE $2::timestamptz END
	  AND NOT EXISTS (SELECT 1 FROM wallet_settled_entries x WHERE x.scope = $5 AND x.entry_id = w.id)
	ON CONFLICT DO NOTHING
	RETURNING entry_id
)
INSERT INTO wallet_settlements (id, settlement_key, period_start, period_end, entries, total_cents, fence)
SELECT (SELECT id FROM s), $1, $2, $3, count(*), coalesce(sum(w.amount_cents), 0), $4
FROM claimed c JOIN wallet_entries w ON w.id = c.entry_id
RETURNING id, entries, total_cents`

const periodEnded = `SELECT clock_timestamp() >= $1`

// Settle writes s's settlement in tx, the transaction that also records the job's
// completion: one row summing the wallet entries of s's period that no settlement of its
// schedule entry has summed, with those stamped earlier whose transactions committed
// after their own period was settled (within SettleLateness), carrying the claim's fence.
// It is a transactional handler for a periodic job (one job per tick). A period that has
// not ended by the database's clock is an error, retried: nothing is settled before its
// end.
func Settle(ctx context.Context, tx pgx.Tx, s tasks.Settle) (json.RawMessage, error) {
	_, fence, ok := idempotency.FromContext(ctx)
	if !ok {
		return nil, errors.New("handlers: Settle must run inside the ledger (no fence in context)")
	}
	res := SettleResult{}
	res.PeriodStart, res.PeriodEnd = s.Span()
	// The period must have ended by the database's clock, the one that stamps the
	// entries: a job enqueued early (a replica's clock ahead) would miss the period's
	// last entries, and the next period does not hold them. It is retried instead.
	var ended bool
	if err := tx.QueryRow(ctx, periodEnded, res.PeriodEnd).Scan(&ended); err != nil {
		return nil, fmt.Errorf("settle %s: %w", s.Key(), err)
	}
	if !ended {
		return nil, fmt.Errorf("settle %s: its period ends at %s, after the database's clock: retried later",
			s.Key(), res.PeriodEnd.UTC().Format(time.RFC3339))
	}
	// A schedule entry's ticks share a scope, so that a late entry is summed by the next
	// one; a manual run is a report of its own.
	scope := s.Entry
	if s.Manual != "" {
		scope = s.Key()
	}
	if err := tx.QueryRow(ctx, insertSettlement, s.Key(), res.PeriodStart, res.PeriodEnd, fence, scope, SettleLateness).
		Scan(&res.SettlementID, &res.Entries, &res.TotalCents); err != nil {
		return nil, fmt.Errorf("settle %s: %w", s.Key(), err)
	}
	return json.Marshal(res)
}
