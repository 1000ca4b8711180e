// Package unguarded holds handlers with no lock and no ledger: plain at-least-once
// processing, duplicates and all. They exist to show (idemq demo) and to test (the
// negative controls, the benchmarks' bare baseline) what the guards prevent; never use
// them for real work.
package unguarded

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/handlers"
	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/tasks"
)

// Leased returns a handler that decodes each delivery and runs fn on it with no
// lock and no ledger: plain at-least-once processing, duplicates and all. It exists to
// show (idemq demo) and to test (negative controls) what the guards prevent; never use it
// for real work. fn's context carries the key and fence 0 (idempotency.FromContext).
func Leased[T idempotency.Job](taskType string, decode func([]byte) (T, error), fn func(ctx context.Context, job T) (json.RawMessage, error)) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		job, err := decode(t.Payload())
		if err != nil {
			return fmt.Errorf("%s: bad payload: %v: %w", taskType, err, asynq.SkipRetry)
		}
		_, err = fn(idempotency.NewContext(ctx, job.Key()), job)
		return err
	})
}

// Transactional is Leased for a transactional fn: each delivery runs fn
// in a transaction of its own on pool, with no claim and no completion.
func Transactional[T idempotency.Job](pool *pgxpool.Pool, taskType string, decode func([]byte) (T, error), fn func(ctx context.Context, tx pgx.Tx, job T) (json.RawMessage, error)) asynq.Handler {
	return Leased(taskType, decode, func(ctx context.Context, job T) (json.RawMessage, error) {
		var out json.RawMessage
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var err error
			out, err = fn(ctx, tx, job)
			return err
		})
		return out, err
	})
}

// TransactionalSQL is Transactional for a database/sql fn: each delivery runs fn in a
// transaction of its own on db, with no claim and no completion.
func TransactionalSQL[T idempotency.Job](db *sql.DB, taskType string, decode func([]byte) (T, error), fn func(ctx context.Context, tx *sql.Tx, job T) (json.RawMessage, error)) asynq.Handler {
	return Leased(taskType, decode, func(ctx context.Context, job T) (json.RawMessage, error) {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return nil, err
		}
		defer tx.Rollback()
		out, err := fn(ctx, tx, job)
		if err != nil {
			return nil, err
		}
		return out, tx.Commit()
	})
}

// Checkout is handlers.Charger.Checkout's three effects with no step records: each
// delivery charges (the provider's key still saves the charge), inserts an order row and
// sends a receipt, so a redelivered checkout records a second order and emails twice.
// Use it with Leased, as the checkout's fn.
func Checkout(ch *handlers.Charger, pool *pgxpool.Pool) func(ctx context.Context, c tasks.Checkout) (json.RawMessage, error) {
	return func(ctx context.Context, c tasks.Checkout) (json.RawMessage, error) {
		key := c.Key()
		chargeKey, err := idempotency.StepKey(key, "charge")
		if err != nil {
			return nil, err
		}
		receiptKey, err := idempotency.StepKey(key, "receipt")
		if err != nil {
			return nil, err
		}
		charge, err := ch.ChargeCheckout(ctx, chargeKey, c)
		if err != nil {
			return nil, err
		}
		var row int64
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			row, err = handlers.RecordOrder(ctx, tx, c, charge.ChargeID)
			return err
		})
		if err != nil {
			return nil, err
		}
		email, err := ch.SendReceipt(ctx, receiptKey, c)
		if err != nil {
			return nil, err
		}
		return json.Marshal(handlers.CheckoutResult{ChargeID: charge.ChargeID, OrderRow: row, EmailID: email})
	}
}
