// Package txshim is the pgx.Tx a DoTx handler gets: the transaction DoTx began in the
// claim's round trip (a pgx.Tx from Conn.BeginTx would cost a round trip of its own), or,
// in a shared transaction, the delivery's savepoint in it.
package txshim

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrHandlerEndsTx is returned by Commit and Rollback of the transaction a DoTx handler
// gets: DoTx commits the handler's writes together with the completion, or rolls both
// back.
var ErrHandlerEndsTx = errors.New("idempotency: a DoTx handler cannot commit or roll back its transaction; return a result or an error")

// Tx is the pgx.Tx a DoTx handler gets. Queries go straight to the connection. Begin (a savepoint) and LargeObjects use a pgx transaction
// handle made on first use, in the open transaction, for one round trip.
type Tx struct {
	conn   *pgx.Conn
	handle pgx.Tx
	// first, if set, runs once before the handler's first use of the transaction (a
	// shared transaction makes the member's savepoint there); its error is that use's.
	first    func(ctx context.Context) error
	firstErr error
}

// New returns the Tx on conn's open transaction; first, if not nil, runs once before the
// handler's first use of it (a shared transaction makes the member's savepoint there).
func New(conn *pgx.Conn, first func(ctx context.Context) error) *Tx {
	return &Tx{conn: conn, first: first}
}

// use runs first once.
func (t *Tx) use(ctx context.Context) error {
	if t.first != nil {
		f := t.first
		t.first = nil
		t.firstErr = f(ctx)
	}
	return t.firstErr
}

var _ pgx.Tx = (*Tx)(nil)

// pgxHandle returns a pgx.Tx on the open transaction. Its BeginQuery begins nothing: the
// transaction is already open.
func (t *Tx) pgxHandle(ctx context.Context) (pgx.Tx, error) {
	if err := t.use(ctx); err != nil {
		return nil, err
	}
	if t.handle == nil {
		h, err := t.conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: "SELECT 1"})
		if err != nil {
			return nil, err
		}
		t.handle = h
	}
	return t.handle, nil
}

// Begin starts a pseudo nested transaction (a savepoint), as pgx does.
func (t *Tx) Begin(ctx context.Context) (pgx.Tx, error) {
	h, err := t.pgxHandle(ctx)
	if err != nil {
		return nil, err
	}
	return h.Begin(ctx)
}

// Commit returns an error: DoTx commits.
func (t *Tx) Commit(context.Context) error { return ErrHandlerEndsTx }

// Rollback returns an error: DoTx rolls back when the handler returns an error.
func (t *Tx) Rollback(context.Context) error { return ErrHandlerEndsTx }

func (t *Tx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	if err := t.use(ctx); err != nil {
		return 0, err
	}
	return t.conn.CopyFrom(ctx, tableName, columnNames, rowSrc)
}

func (t *Tx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if err := t.use(ctx); err != nil {
		return errBatchResults{err}
	}
	return t.conn.SendBatch(ctx, b)
}

// LargeObjects returns the large object API on the transaction. The first call (or
// Begin) costs a round trip, bounded by 10 seconds. pgx.LargeObjects can only be made by
// pgx, and this method cannot return an error: if that round trip fails (the connection
// is broken), it panics with the error, and DoTx rolls back and panics again.
func (t *Tx) LargeObjects() pgx.LargeObjects {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	h, err := t.pgxHandle(ctx)
	if err != nil {
		panic(fmt.Errorf("idempotency: DoTx large objects: %w", err))
	}
	return h.LargeObjects()
}

func (t *Tx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.use(ctx); err != nil {
		return nil, err
	}
	return t.conn.Prepare(ctx, name, sql)
}

func (t *Tx) Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error) {
	if err := t.use(ctx); err != nil {
		return pgconn.CommandTag{}, err
	}
	return t.conn.Exec(ctx, sql, arguments...)
}

func (t *Tx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := t.use(ctx); err != nil {
		return nil, err
	}
	return t.conn.Query(ctx, sql, args...)
}

func (t *Tx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if err := t.use(ctx); err != nil {
		return errRow{err}
	}
	return t.conn.QueryRow(ctx, sql, args...)
}

func (t *Tx) Conn() *pgx.Conn { return t.conn }

// errRow is a pgx.Row whose Scan returns err.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// errBatchResults is a pgx.BatchResults on which everything returns err.
type errBatchResults struct{ err error }

func (r errBatchResults) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, r.err }
func (r errBatchResults) Query() (pgx.Rows, error)         { return nil, r.err }
func (r errBatchResults) QueryRow() pgx.Row                { return errRow(r) }
func (r errBatchResults) Close() error                     { return r.err }
func (r errBatchResults) Tx() pgx.Tx                       { return nil }
