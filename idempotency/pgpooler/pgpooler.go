package pgpooler

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency/internal/store"
)

// Kind is what stands between a client and Postgres.
type Kind int

const (
	// Direct: the connection is a session of Postgres itself.
	Direct Kind = iota
	// SessionPooler: a pooler that keeps one server connection per client session.
	SessionPooler
	// TransactionPooler: a pooler that may change the server connection between
	// transactions.
	TransactionPooler
)

func (k Kind) String() string {
	switch k {
	case Direct:
		return "direct"
	case SessionPooler:
		return "session pooler"
	}
	return "transaction pooler"
}

// IsPreparedStatementError reports whether err is what named prepared statements meet
// behind a transaction-mode pooler, whose server connections change from one transaction
// to the next: SQLSTATE 42P05 (duplicate_prepared_statement) or 26000
// (invalid_sql_statement_name). pgx's default exec mode prepares named statements; use
// QueryExecModeCacheDescribe (default_query_exec_mode=cache_describe) there.
func IsPreparedStatementError(err error) bool {
	return store.IsCode(err, store.DuplicatePreparedStatement, store.InvalidSQLStatementName)
}

// rounds is how many times Detect asks a pooler which server connections two clients get.
const rounds = 3

// Detect connects to cfg twice and tells what is between them and Postgres:
//
//   - Postgres itself reports, in pg_backend_pid(), the process id it sent at start-up
//     (BackendKeyData); a pooler sends its own key, so the two differ.
//   - Behind a pooler, client a asks for its backend, then client b, then a again. A
//     transaction pooler releases a's server connection after each statement and hands
//     the most recently used one out first (PgBouncer's default), so b gets a's, or a
//     gets another; a session pooler keeps a's for a, always.
//
// It uses the simple protocol, so it works whatever cfg's exec mode.
func Detect(ctx context.Context, cfg *pgx.ConnConfig) (Kind, error) {
	cfg = cfg.Copy()
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	a, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return 0, err
	}
	defer a.Close(context.WithoutCancel(ctx))
	pa, err := backend(ctx, a)
	if err != nil {
		return 0, err
	}
	if pa == a.PgConn().PID() {
		return Direct, nil
	}
	b, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return 0, err
	}
	defer b.Close(context.WithoutCancel(ctx))
	for range rounds {
		pb, err := backend(ctx, b)
		if err != nil {
			return 0, err
		}
		again, err := backend(ctx, a)
		if err != nil {
			return 0, err
		}
		if pb == pa || again != pa {
			return TransactionPooler, nil
		}
	}
	return SessionPooler, nil
}

// IsPooled reports whether conn goes through a pooler of either kind (see Detect).
func IsPooled(ctx context.Context, conn *pgx.Conn) (bool, error) {
	pid, err := backend(ctx, conn)
	return pid != conn.PgConn().PID(), err
}

func backend(ctx context.Context, c *pgx.Conn) (uint32, error) {
	var pid uint32
	if err := c.QueryRow(ctx, "SELECT pg_backend_pid()", pgx.QueryExecModeSimpleProtocol).Scan(&pid); err != nil {
		return 0, fmt.Errorf("ask Postgres for its backend: %w", err)
	}
	return pid, nil
}
