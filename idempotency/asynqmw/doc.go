// Package asynqmw runs asynq handlers under idemq's guards. Each delivery goes, in order:
// decode and validate the payload (bad input is archived with the reason, asynq.SkipRetry)
// → the Redis lock on the job's scope (skipped when the scope is the key) → the ledger's
// claim (a completed key answers with its stored result; a busy one is retried soon and
// is not a failure) → the handler → the fenced completion → the lock handed to the
// scope's next delivery or released in the background (a leased job of a scope wider
// than its key hands it on as soon as its handler returns) → the result written to the
// task (what asynqmon shows). At shutdown call Worker.Stop before asynq.Server.Shutdown
// and Worker.Wait after it.
//
// Leased wraps a handler with an external effect (it runs under a heartbeated lease, with
// the key in its context for the provider: idempotency.FromContext); Transactional one
// whose effect lives in the ledger's Postgres (its writes and the completion commit in
// one transaction). Configure sets asynq's IsFailure and RetryDelayFunc so that busy keys
// and locks never burn a task's retries.
//
//	ledger := idempotency.New(pool, nil)
//	defer ledger.Close()
//	w := asynqmw.NewWorker(ledger, lock.New(rdb, nil), nil)
//	mux := asynq.NewServeMux()
//	mux.Handle(tasks.TypeDebit, asynqmw.Transactional(w, tasks.TypeDebit, tasks.DecodeDebit, handlers.Debit))
//	cfg := asynq.Config{Concurrency: 20}
//	asynqmw.Configure(&cfg)
//	srv := asynq.NewServerFromRedisClient(rdb, cfg)
package asynqmw
