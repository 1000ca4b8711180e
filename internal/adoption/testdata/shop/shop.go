// Package shop is a small application that runs its background jobs with idemq: a refund
// written to its own table (a transactional job) and a receipt sent through an email
// provider (a leased job).
package shop

import (
	"context"
	"encoding/json"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/idempotency/server"
)

// The task types.
const (
	TypeRefund  = "shop:refund"
	TypeReceipt = "shop:receipt"
)

// Refund pays an order's amount back, once per order.
type Refund struct {
	Order string `json:"order"`
	Cents int64  `json:"cents"`
}

func (r Refund) Key() string       { return "refund:" + r.Order }
func (r Refund) LockScope() string { return "order:" + r.Order }

// Validate refuses a refund without an order or amount.
func (r Refund) Validate() error {
	if r.Order == "" || r.Cents <= 0 {
		return errors.New("refund: order and a positive cents are required")
	}
	return nil
}

// RefundOrder is the refund's handler: its effect is a row written in tx, which commits
// with the job's completion.
func RefundOrder(ctx context.Context, tx pgx.Tx, r Refund) (json.RawMessage, error) {
	_, err := tx.Exec(ctx, `INSERT INTO refunds (order_id, cents) VALUES ($1, $2)`, r.Order, r.Cents)
	return nil, err
}

// Receipt emails an order's receipt, once per order.
type Receipt struct {
	Order string `json:"order"`
	To    string `json:"to"`
}

func (r Receipt) Key() string       { return "receipt:" + r.Order }
func (r Receipt) LockScope() string { return r.Key() }

// Mailer stands in for an email provider that honours idempotency keys: it keeps one
// receipt per key and counts every call.
type Mailer struct {
	DB *pgxpool.Pool
}

// Send sends r under the idempotency key key.
func (m Mailer) Send(ctx context.Context, key string, r Receipt) error {
	select { // a provider's round trip
	case <-time.After(20 * time.Millisecond):
	case <-ctx.Done():
		return ctx.Err()
	}
	_, err := m.DB.Exec(ctx, `INSERT INTO receipts (idempotency_key, order_id, email) VALUES ($1, $2, $3)
		ON CONFLICT (idempotency_key) DO UPDATE SET calls = receipts.calls + 1`, key, r.Order, r.To)
	return err
}

// SendReceipt is the receipt's handler: it hands the job's key to the provider.
func (m Mailer) SendReceipt(ctx context.Context, r Receipt) (json.RawMessage, error) {
	key, _, _ := idempotency.FromContext(ctx)
	return nil, m.Send(ctx, key, r)
}

// Spec returns the outbox spec that accepts job as a task of taskType.
func Spec(taskType string, job idempotency.Job) (outbox.Spec, error) {
	payload, err := json.Marshal(job)
	return outbox.Spec{Key: job.Key(), Type: taskType, Payload: payload, Queue: "default",
		MaxRetry: 25, Timeout: time.Minute, Retention: 24 * time.Hour}, err
}

// Register registers the shop's jobs: on its server in main, on the harness's workers in
// its tests.
func Register(r server.Registrar, mailer Mailer) {
	server.HandleTx(r, TypeRefund, RefundOrder)
	server.HandleLeased(r, TypeReceipt, mailer.SendReceipt)
}
