package handlers

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/tasks"
)

// CheckoutResult is what a completed order:checkout records: each step's outcome.
type CheckoutResult struct {
	ChargeID string `json:"charge_id"`
	OrderRow int64  `json:"order_row"`
	EmailID  int64  `json:"email_id"`
}

// Checkout runs order:checkout as three recorded steps (idempotency.Step and StepTx), in
// a leased handler: charge the card at the provider (its key honoured there), record the
// order in the orders table (in the step's own transaction, so exactly once without any
// provider's help), and email the receipt through an endpoint that honours no key. A
// delivery that resumes a checkout another one began skips the steps already recorded.
// The receipt is the honest limit: a worker that dies after the provider accepted the
// email and before the step was recorded sends it again on the next delivery.
func (ch *Charger) Checkout(ctx context.Context, c tasks.Checkout) (json.RawMessage, error) {
	charge, err := idempotency.Step(ctx, "charge", func(ctx context.Context, key string) (ChargeResult, error) {
		return ch.ChargeCheckout(ctx, key, c)
	}, idempotency.StepInput(c))
	if err != nil {
		return nil, err
	}
	row, err := idempotency.StepTx(ctx, "record", func(ctx context.Context, tx pgx.Tx) (int64, error) {
		return RecordOrder(ctx, tx, c, charge.ChargeID)
	})
	if err != nil {
		return nil, err
	}
	email, err := idempotency.Step(ctx, "receipt", func(ctx context.Context, key string) (int64, error) {
		return ch.SendReceipt(ctx, key, c)
	})
	if err != nil {
		return nil, err
	}
	return json.Marshal(CheckoutResult{ChargeID: charge.ChargeID, OrderRow: row, EmailID: email})
}

// ChargeCheckout is a checkout's first effect: it charges c's amount at the provider
// under key (the step key), which the provider honours.
func (ch *Charger) ChargeCheckout(ctx context.Context, key string, c tasks.Checkout) (ChargeResult, error) {
	raw, err := ch.Charge(ctx, key, c.Charge())
	var r ChargeResult
	if err == nil {
		err = json.Unmarshal(raw, &r)
	}
	return r, err
}

// RecordOrder is a checkout's second effect: a row in orders, with the fence of the claim
// in ctx (idempotency.FromContext; 0 without one). The table has no unique constraint on
// the order: only the step's record keeps a second row out.
func RecordOrder(ctx context.Context, tx pgx.Tx, c tasks.Checkout, chargeID string) (int64, error) {
	_, fence, _ := idempotency.FromContext(ctx)
	var id int64
	err := tx.QueryRow(ctx, `INSERT INTO orders (order_id, customer_id, amount_cents, currency, charge_id, fence)
		VALUES ($1, $2, $3, $4, $5, $6) RETURNING id`, c.OrderID, c.CustomerID, c.AmountCents, c.Currency, chargeID, fence).Scan(&id)
	return id, err
}

// SendReceipt is a checkout's third effect: the receipt, emailed through an endpoint that
// honours no idempotency key (key is sent all the same, for the record, as HeaderKey: an
// Idempotency-Key would tell Go's transport the request is safe to send twice). It
// returns the provider's id of the email.
func (ch *Charger) SendReceipt(ctx context.Context, key string, c tasks.Checkout) (int64, error) {
	raw, err := ch.post(ctx, ch.emails, "receipt", HeaderKey, key, map[string]string{
		"to": c.Email, "subject": "Your receipt", "order_id": c.OrderID})
	if err != nil {
		return 0, err
	}
	var sent struct {
		ID int64 `json:"id"`
	}
	if err := json.Unmarshal(raw, &sent); err != nil || sent.ID == 0 {
		return 0, fmt.Errorf("receipt %s: unreadable provider answer %.200q", key, raw)
	}
	return sent.ID, nil
}
