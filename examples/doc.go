// Package examples holds no code of its own: each directory below is an idemq worker
// whose handler writes through one ORM or query builder over the *sql.Tx
// server.HandleSQLTx hands it (gorm, sqlx, ent, bun, sqlc), with a test that runs it
// through idempotencytest. This package's test runs Ledger.DoSQLTx on lib/pq. See
// README.md.
package examples
