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

const insertSettlement = `INSERT INTO wallet_settlements (settlement_key, period_start, period_end, entries, total_cents, fence)
	SELECT $1, $2, $3, count(*), coalesce(sum(amount_cents), 0), $4
	FROM wallet_entries WHERE created_at > $2 AND created_at <= $3
	RETURNING id, entries, total_cents`

const periodEnded = `SELECT clock_timestamp() >= $1`

// Settle writes s's settlement in tx, the transaction that also records the job's
// completion: one row summing the wallet entries of s's period, carrying the claim's
// fence. It is a transactional handler for a periodic job (one job per tick). A period
// that has not ended by the database's clock is an error, retried: nothing is settled
// before its end.
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
	if err := tx.QueryRow(ctx, insertSettlement, s.Key(), res.PeriodStart, res.PeriodEnd, fence).
		Scan(&res.SettlementID, &res.Entries, &res.TotalCents); err != nil {
		return nil, fmt.Errorf("settle %s: %w", s.Key(), err)
	}
	return json.Marshal(res)
}
