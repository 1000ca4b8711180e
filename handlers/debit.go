package handlers

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/tasks"
)

// DebitResult is what a completed wallet:debit records: the wallet entry it wrote.
type DebitResult struct {
	EntryID     int64     `json:"entry_id"`
	AccountID   string    `json:"account_id"`
	AmountCents int64     `json:"amount_cents"`
	Reference   string    `json:"reference"`
	Fence       int64     `json:"fence"`
	CreatedAt   time.Time `json:"created_at"`
}

const insertEntry = `INSERT INTO wallet_entries (account_id, amount_cents, reference, fence)
	VALUES ($1, $2, $3, $4) RETURNING id, created_at`

// Debit writes d's wallet entry in tx, the transaction that also records the job's
// completion, so the entry exists exactly when the debit is completed. The entry carries
// the claim's fence. Debit does no I/O outside tx.
func Debit(ctx context.Context, tx pgx.Tx, d tasks.Debit) (json.RawMessage, error) {
	_, fence, ok := idempotency.FromContext(ctx)
	if !ok {
		return nil, errors.New("handlers: Debit must run inside the ledger (no fence in context)")
	}
	res := DebitResult{AccountID: d.AccountID, AmountCents: d.AmountCents, Reference: d.Reference, Fence: fence}
	if err := tx.QueryRow(ctx, insertEntry, d.AccountID, d.AmountCents, d.Reference, fence).Scan(&res.EntryID, &res.CreatedAt); err != nil {
		return nil, fmt.Errorf("debit %s: insert wallet entry: %w", d.Key(), err)
	}
	return json.Marshal(res)
}

// DebitSQL is Debit through database/sql (server.HandleSQLTx): the same entry in tx, the
// same result.
func DebitSQL(ctx context.Context, tx *sql.Tx, d tasks.Debit) (json.RawMessage, error) {
	_, fence, ok := idempotency.FromContext(ctx)
	if !ok {
		return nil, errors.New("handlers: DebitSQL must run inside the ledger (no fence in context)")
	}
	res := DebitResult{AccountID: d.AccountID, AmountCents: d.AmountCents, Reference: d.Reference, Fence: fence}
	if err := tx.QueryRowContext(ctx, insertEntry, d.AccountID, d.AmountCents, d.Reference, fence).Scan(&res.EntryID, &res.CreatedAt); err != nil {
		return nil, fmt.Errorf("debit %s: insert wallet entry: %w", d.Key(), err)
	}
	return json.Marshal(res)
}
