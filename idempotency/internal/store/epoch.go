package store

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// The outbox's epoch rows (redis_epochs): for each queue it publishes into, the marker
// and the Redis run_id a reconcile round last checked the queue under.

// ensureEpochSQL records a queue's row unless it has one (ensure_epoch.sql).
var ensureEpochSQL = sqlText("ensure_epoch", nil)

// EnsureEpoch records queue's row with marker epoch, unless it has one.
func EnsureEpoch(ctx context.Context, q DB, queue, epoch string) error {
	_, err := q.Exec(ctx, ensureEpochSQL, queue, epoch)
	return err
}

// Epoch is a queue's epoch row.
type Epoch struct {
	Queue, Epoch string
	RedisRunID   string // "" until a round recorded one
}

// epochsSQL reads every queue's row (epochs.sql).
var epochsSQL = sqlText("epochs", nil)

// Epochs returns every queue's epoch row, by queue.
func Epochs(ctx context.Context, q DB) ([]Epoch, error) {
	rows, err := q.Query(ctx, epochsSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (Epoch, error) {
		var e Epoch
		err := row.Scan(&e.Queue, &e.Epoch, &e.RedisRunID)
		return e, err
	})
}

// settleEpochSQL records a queue's marker and run_id (settle_epoch.sql).
var settleEpochSQL = sqlText("settle_epoch", nil)

// SettleEpoch records e (its marker and run_id) as its queue's row.
func SettleEpoch(ctx context.Context, q DB, e Epoch) error {
	_, err := q.Exec(ctx, settleEpochSQL, e.Queue, e.Epoch, e.RedisRunID)
	return err
}

var (
	hasEpochSQL    = sqlText("has_epoch", nil)    // has_epoch.sql
	deleteEpochSQL = sqlText("delete_epoch", nil) // delete_epoch.sql
)

// HasEpoch reports whether queue has an epoch row.
func HasEpoch(ctx context.Context, q DB, queue string) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, hasEpochSQL, queue).Scan(&ok)
	return ok, err
}

// DeleteEpoch removes queue's epoch row, if it has one.
func DeleteEpoch(ctx context.Context, q DB, queue string) error {
	_, err := q.Exec(ctx, deleteEpochSQL, queue)
	return err
}
