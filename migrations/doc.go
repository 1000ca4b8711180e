// Package migrations holds idemq's versioned SQL and applies it with goose.
//
// The SQL comes in two sets, both embedded, so the binary carries its schema:
//
//   - the core set (this directory): the ledger (processed_jobs, the recorded steps
//     of leased jobs, processed_job_steps, and each key's history, processed_job_events), the outbox (job_intents,
//     redis_epochs), the periodic schedule (schedule_entries) and the API's memory of
//     Idempotency-Key headers (api_idempotency_keys), and the registry of running
//     processes (idemq_processes). Up applies it and records its versions in idemq_db_version.
//   - the example set (the example directory): the tables of the example handlers and of
//     the stand-in payment provider (wallet_entries, wallet_settlements, orders,
//     fakepay_requests, fakepay_charges, fakepay_emails; docs/leases.md lists every table).
//     `idemq migrate` applies it after the core set; UpExample applies it and records its
//     versions in idemq_example_db_version. Up never creates these tables: an
//     application using the library does not need them.
//
// A library user applies the core set beside the application's own migrations, through
// the application's pgx pool or any *sql.DB whose connections use the schema:
//
//	if _, err := migrations.UpPool(ctx, pool); err != nil {
//		return err
//	}
//	// or: if _, err := migrations.Up(ctx, db); err != nil { … }
//
// Neither set reads or writes goose's default version table (goose_db_version) or takes
// goose's default lock, so an application that migrates its own schema with goose can run
// idemq's migrations before its own, after them, or from inside one of its own
// migrations.
//
// Two processes migrating one schema at once are serialised by a Postgres session
// advisory lock whose id is derived from "idemq-migrations:" and the schema's name, so
// running `idemq migrate` from every replica is safe, and migrations of different schemas
// (parallel tests) do not wait for each other. A caller waits for another migrator for up
// to 5 minutes.
//
// Migrations are expand steps unless marked as contract steps (see Step): Up and
// UpExample refuse a pending contract step, applying nothing, while a process registered
// in idemq_processes with an older schema version is alive (a *ContractError).
//
// Before idemq had version tables of its own, both sets were recorded in goose's
// default table, goose_db_version. Such a schema is carried over the first time a
// provider of this package takes its lock (Up, UpExample, a provider's Up, UpTo or
// Status): the versions an older idemq applied are recorded in idemq's version tables, so
// nothing runs again, and goose_db_version is left as it is. Which versions those are is
// read from the schema's objects (processed_jobs for the core set, fakepay_requests for
// the example's, then each later migration's table, column or constraint), never from
// goose_db_version, whose rows may be the application's under the same numbers.
//
// Status and Check only read: they create no version table and carry nothing over, so a
// schema they looked at (a dry run, a start refused) is left exactly as it was.
package migrations
