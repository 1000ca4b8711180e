// Package outbox records accepted jobs in Postgres (job_intents) and publishes them to
// asynq, so that a job a web app was told is accepted survives a Redis that loses it.
//
// EnqueueTx records a job's intent inside the caller's own transaction: the job is
// accepted exactly when that transaction commits. A relay (RunRelay, on every replica)
// publishes pending intents under TaskID = key; a reconciler (RunReconciler) republishes
// published jobs whose task Redis no longer has, under TaskID key#r<n>, after a grace
// period, or at once when Redis lost the queue's data (epoch markers: see RunReconciler).
// The intent becomes done in the same transaction as the ledger's completion.
//
//	client := outbox.NewClient(pool, rdb, nil)
//	go client.RunRelay(ctx)
//	go client.RunReconciler(ctx)
//	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//		// ... the web app's own writes ...
//		_, err := client.EnqueueTx(ctx, tx, spec) // spec from tasks.ChargeSpec, say
//		return err
//	})
//	client.Wake(ctx) // publish now rather than at the next poll
//
// An HTTP API that accepts jobs can honour the Idempotency-Key request header with
// request keys (RequestKey, recorded in api_idempotency_keys in the same transaction as
// the job's intent): QueueRecordRequestKeys records them, ReadRequestKeysTx finds a
// repeat's first answer, PurgeRequestKeys forgets old ones.
package outbox
