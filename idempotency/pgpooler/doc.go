// Package pgpooler tells whether a Postgres connection configuration reaches Postgres
// itself, a pooler that gives each client a server connection for its whole session, or a
// transaction-mode pooler (PgBouncer's pool_mode=transaction) that hands each transaction
// whichever server connection is free. Behind the last, session state is lost between
// transactions: a LISTEN goes deaf (and pins a server connection), a session advisory
// lock (goose's migration lock) protects nothing, and named prepared statements meet the
// wrong connection.
//
// Check at start, before LISTENing or migrating, what a URL reaches:
//
//	cfg, err := pgx.ParseConfig(databaseURL)
//	if err != nil {
//		return err
//	}
//	kind, err := pgpooler.Detect(ctx, cfg)
//	if err != nil {
//		return err
//	}
//	if kind == pgpooler.TransactionPooler {
//		return errors.New("migrate through a direct URL, not a transaction-mode pooler")
//	}
//
// IsPooled tells, on a connection already open, only whether it goes through a pooler
// of either kind.
package pgpooler
