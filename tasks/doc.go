// Package tasks defines idemq's example task types: their names, payloads, the keys and
// lock scopes derived from them, and constructors that set asynq's options.
//
// A key comes from intent, never from randomness: charging order 123 is always
// "charge:123", however often it is enqueued or retried. The key is asynq's TaskID for
// the first publish, the ledger key and the idempotency key handed to the provider.
//
// Publish a job directly (a second publish of the same order is a duplicate, not a
// second job):
//
//	t, err := tasks.NewChargeTask(tasks.Charge{OrderID: "123", CustomerID: "42", AmountCents: 1999, Currency: "EUR"})
//	info, dup, err := tasks.Enqueue(ctx, client, t)
//
// or record it through the outbox, in the caller's own transaction:
//
//	spec, err := tasks.ChargeSpec(charge)
//	res, err := outboxClient.EnqueueTx(ctx, tx, spec)
//
// and decode it on the worker (asynqmw.Leased and asynqmw.Transactional take the
// decoder):
//
//	mux.Handle(tasks.TypeCharge, asynqmw.Leased(w, tasks.TypeCharge, tasks.DecodeCharge, charge))
package tasks
