package dial

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency/pgpooler"
	"github.com/idemq/idemq/internal/config"
)

// Database is a long-running program's connections to Postgres.
type Database struct {
	// Pool serves transactions, on DATABASE_URL.
	Pool *pgxpool.Pool
	// Pooled is true when DATABASE_URL reaches a transaction-mode pooler.
	Pooled bool
	// Session configures the connections that need a session of Postgres itself (the
	// relays' LISTEN): IDEMQ_DIRECT_DATABASE_URL, else DATABASE_URL unless it reaches a
	// transaction-mode pooler; nil then.
	Session *pgx.ConnConfig
	// Heartbeats, when DATABASE_URL reaches a pooler and IDEMQ_DIRECT_DATABASE_URL is
	// set, is a pool of at most 2 connections on the latter, so heartbeats do not wait
	// behind the pooler's capped server connections; nil otherwise (the ledger opens its
	// own on Pool's configuration).
	Heartbeats *pgxpool.Pool
}

// Close closes the pools.
func (d *Database) Close() {
	d.Pool.Close()
	if d.Heartbeats != nil {
		d.Heartbeats.Close()
	}
}

// OpenDatabase opens dsn (DATABASE_URL) as Postgres does, and direct
// (IDEMQ_DIRECT_DATABASE_URL, may be empty) for what needs Postgres itself. It refuses a
// direct URL that reaches a transaction-mode pooler, and logs what a pooled DATABASE_URL
// without one costs.
func OpenDatabase(ctx context.Context, dsn, direct string, maxConns int32, log *slog.Logger) (*Database, error) {
	pool, kind, err := postgres(ctx, "DATABASE_URL", dsn, maxConns)
	if err != nil {
		return nil, err
	}
	d := &Database{Pool: pool, Pooled: kind == pgpooler.TransactionPooler}
	switch {
	case direct != "":
		pc, err := pgxpool.ParseConfig(direct)
		if err != nil {
			pool.Close()
			return nil, fmt.Errorf("IDEMQ_DIRECT_DATABASE_URL: %w", config.URLError(direct, err))
		}
		if err := RequireSession(ctx, pc.ConnConfig, "IDEMQ_DIRECT_DATABASE_URL"); err != nil {
			pool.Close()
			if errors.Is(err, ErrTransactionPooler) {
				return nil, fmt.Errorf("%w: point it at Postgres itself (or a session pooler)", err)
			}
			return nil, err
		}
		d.Session = pc.ConnConfig
		if d.Pooled {
			pc.MaxConns, pc.MinConns = 2, 0
			pc.ConnConfig.DefaultQueryExecMode = pool.Config().ConnConfig.DefaultQueryExecMode
			if d.Heartbeats, err = pgxpool.NewWithConfig(ctx, pc); err != nil {
				pool.Close()
				return nil, fmt.Errorf("connect to Postgres (IDEMQ_DIRECT_DATABASE_URL): %w", err)
			}
		}
	case !d.Pooled:
		d.Session = pool.Config().ConnConfig
	default:
		// The outbox finds the pooler on its own and says that its relays poll.
		log.Warn("DATABASE_URL reaches a transaction-mode pooler and IDEMQ_DIRECT_DATABASE_URL is not set: " +
			"heartbeats queue for the pooler's server connections (set IDEMQ_DIRECT_DATABASE_URL to Postgres itself)")
	}
	if d.Pooled {
		log.Info("DATABASE_URL reaches a transaction-mode pooler", "query_exec_mode", pool.Config().ConnConfig.DefaultQueryExecMode.String(),
			"direct", d.Session != nil)
	}
	return d, nil
}

// ErrTransactionPooler is what RequireSession returns (wrapped) for a transaction-mode
// pooler.
var ErrTransactionPooler = errors.New("reaches a transaction-mode pooler (such as PgBouncer with pool_mode=transaction)")

// RequireSession checks, within 10 s, that cfg (the setting name says which) reaches
// Postgres itself or a session pooler, not a transaction-mode pooler.
func RequireSession(ctx context.Context, cfg *pgx.ConnConfig, name string) error {
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	kind, err := pgpooler.Detect(pctx, cfg)
	if err != nil {
		return fmt.Errorf("connect to Postgres (%s): %w", name, err)
	}
	if kind == pgpooler.TransactionPooler {
		return fmt.Errorf("%s %w", name, ErrTransactionPooler)
	}
	return nil
}
