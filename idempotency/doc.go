// Package idempotency is idemq's completion ledger: one row per idempotency key in
// Postgres (processed_jobs), the source of truth for whether a piece of work happened
// and what it returned.
//
// Every claim is an identity: a fence from a global sequence (never reused) and a random
// owner. Every write after a claim is fenced by both, so a worker whose lease ended (GC
// pause, SIGSTOP, partition) cannot complete, extend or overwrite what a newer owner
// holds. Lease arithmetic uses the database clock. Completions commit with
// synchronous_commit on; a commit whose answer was lost is resolved with its transaction
// id (pg_xact_status), not by reading the row.
//
// Two handler modes:
//
//   - Do (leased) for external effects: the claim commits first, the handler runs under
//     a heartbeated lease with the key in its context (FromContext) to hand to the
//     provider as its idempotency key, and the completion is fenced. If the worker dies
//     after the external call but before the completion, a later delivery calls the
//     provider again with the same key: exactly-once then rests on the provider honouring
//     it (as Stripe does for about 24 hours, hence Config.MaxAge).
//   - DoTx (transactional) for effects in the same database: the claim, the handler's
//     writes and the completion commit in one transaction; the row lock is the lease. No
//     external I/O inside the transaction.
//
// A leased handler with several effects records them as steps: Step (an external effect,
// handed the step key <job key>#s/<name> for its provider) and StepTx (a database effect in
// a transaction of its own). Each step's result is recorded under a fenced row lock
// (FOR SHARE) of the job's row, in processed_job_steps, so a later delivery of the job gets it back
// without running the step again, and a stale owner can record nothing.
//
// Concurrent requests of one Ledger share commits (Config.DisableGroupCommit turns this
// off): leased claims, and leased completions and failures, are each sent by one
// committer as one multi-row statement per batch, every row checked on its own fence and
// owner; DoTx deliveries run one after another in a shared transaction, a savepoint each.
// A batch is whatever queued while the previous commit was under way (no timer), and no
// caller is answered before its own write is durable.
//
// Usage:
//
//	ledger := idempotency.New(pool, &idempotency.Config{Lease: 30 * time.Second})
//	defer ledger.Close()
//	req := idempotency.Request{
//		Key:         "debit:ref-42",
//		TaskType:    "wallet:debit",
//		Fingerprint: idempotency.Fingerprint("wallet:debit", canonicalPayload),
//	}
//	res, err := ledger.DoTx(ctx, req, func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
//		_, err := tx.Exec(ctx, `INSERT INTO wallet_entries (account_id, amount_cents, reference) VALUES ($1, $2, $3)`, acct, -500, "ref-42")
//		return json.RawMessage(`{"ok":true}`), err
//	})
//	switch {
//	case errors.Is(err, idempotency.ErrBusy): // another worker holds the key: retry later
//	case errors.Is(err, idempotency.ErrMismatch), errors.Is(err, idempotency.ErrFailed): // permanent
//	case err != nil: // retry
//	default: // res.Result; res.Cached tells a duplicate
//	}
//
// The asynq middleware that runs handlers under the ledger (and the Redis lock) is
// idempotency/asynqmw; the outbox that keeps accepted jobs in Postgres until they are
// done is idempotency/outbox.
//
// Terminal means terminal: completed and failed keys are never reopened by a delivery,
// only by an operator's Rerun, which bumps the generation. Rows in progress longer than
// Config.MaxAge become needs_attention instead of running again. Purge removes terminal
// rows older than a retention window; a key delivered after that runs again.
package idempotency
