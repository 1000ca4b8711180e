// Package handlers is idemq's example domain: the business code of each task type, one
// file per type. It holds no retry, lock or ledger logic; the idempotency middleware wraps
// these functions.
//
// A handler reports a permanent failure (one no retry can fix, like a refused card) by
// wrapping asynq.SkipRetry; any other error is retried.
//
// Register them as the worker does: Debit writes in the transaction that completes the
// job, Charger.Charge calls the provider under a lease, with the job's key as its
// idempotency key.
//
//	w := asynqmw.NewWorker(ledger, lock.New(rdb, nil), nil)
//	mux.Handle(tasks.TypeDebit, asynqmw.Transactional(w, tasks.TypeDebit, tasks.DecodeDebit, handlers.Debit))
//
//	charger := handlers.NewCharger(providerURL, nil).WithFenceMargin(ledger.SelfFenceMargin())
//	mux.Handle(tasks.TypeCharge, asynqmw.Leased(w, tasks.TypeCharge, tasks.DecodeCharge,
//		func(ctx context.Context, c tasks.Charge) (json.RawMessage, error) {
//			return charger.Charge(ctx, c.Key(), c)
//		}))
package handlers
