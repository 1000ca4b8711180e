// Package server runs background jobs with exactly-once effects, as `idemq worker` does,
// in one constructor: asynq deliveries through the Redis lock and the Postgres ledger
// (idempotency/asynqmw), the outbox relay and reconciler that keep accepted jobs alive
// when Redis loses them (idempotency/outbox), and the ledger's retention, with the
// binary's defaults. `idemq worker` is built on it, so a program using it runs what the
// binary runs.
//
// Usage:
//
//	srv, err := server.New(server.Config{Postgres: pool, Redis: rdb})
//	if err != nil {
//		return err
//	}
//	server.HandleTx(srv, "wallet:debit", func(ctx context.Context, tx pgx.Tx, d Debit) (json.RawMessage, error) {
//		_, err := tx.Exec(ctx, `INSERT INTO debits (account, cents, ref) VALUES ($1, $2, $3)`, d.Account, d.Cents, d.Ref)
//		return nil, err
//	})
//	server.HandleLeased(srv, "email:receipt", func(ctx context.Context, r Receipt) (json.RawMessage, error) {
//		key, _, _ := idempotency.FromContext(ctx) // the provider's idempotency key
//		return nil, mailer.Send(ctx, key, r)
//	})
//	return srv.Run(ctx) // until ctx ends; then it drains
//
// A job type implements idempotency.Job: a key from intent ("debit:<reference>") and a
// lock scope. Payloads are decoded strictly (idempotency.DecodeStrict) and checked by the
// job's Validate method when it has one (see Decode; WithDecoder replaces both); a
// payload they refuse, and a task of a type nobody registered, is archived at once with
// the reason. Jobs are accepted with Server.Outbox (or an outbox.Client of the web app's
// own): Enqueue, or EnqueueTx inside the caller's transaction.
//
// Size the Postgres pool with PoolSize. Metrics come from the Observe fields of the
// nested configurations (Config.Ledger, Config.Worker, Config.Outbox).
package server
