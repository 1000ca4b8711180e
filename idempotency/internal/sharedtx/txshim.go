package sharedtx

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The pgx.Tx a DoTx handler gets: the transaction DoTx began in the claim's round trip (a
// pgx.Tx from Conn.BeginTx would cost a round trip of its own), or, in a shared
// transaction, the delivery's savepoint in it.

// errHandlerEndsTx is returned by Commit and Rollback of the transaction a DoTx handler
// gets: DoTx commits the handler's writes together with the completion, or rolls both
// back.
var errHandlerEndsTx = errors.New("idempotency: a DoTx handler cannot commit or roll back its transaction; return a result or an error")

// handlerTx is the pgx.Tx a DoTx handler gets. Queries go straight to the connection.
// Begin (a savepoint) and LargeObjects use a pgx transaction handle made on first use, in
// the open transaction, for one round trip.
//
// handlerTx counts how long the handler waits on the database through it (InDB): a query
// from its start until its rows are read or closed. What a handler spends outside (its
// own work, a sleep, a call elsewhere) is what keeps it from sharing a transaction; the
// database's time is what sharing saves.
type handlerTx struct {
	conn   *pgx.Conn
	handle pgx.Tx
	// first, if set, runs once before the handler's first use of the transaction (a
	// shared transaction makes the member's savepoint there); its error is that use's.
	first    func(ctx context.Context) error
	firstErr error
	inDB     time.Duration
}

// InDB is how long the handler has waited on the database through t. Queries on a
// savepoint's handle (Begin) are not counted.
func (t *handlerTx) InDB() time.Duration { return t.inDB }

// since adds the time since start to InDB.
func (t *handlerTx) since(start time.Time) { t.inDB += time.Since(start) }

// newHandlerTx returns the handlerTx on conn's open transaction; first, if not nil, runs
// once before the handler's first use of it (a shared transaction makes the member's
// savepoint there).
func newHandlerTx(conn *pgx.Conn, first func(ctx context.Context) error) *handlerTx {
	return &handlerTx{conn: conn, first: first}
}

// use runs first once.
func (t *handlerTx) use(ctx context.Context) error {
	if t.first != nil {
		f := t.first
		t.first = nil
		t.firstErr = f(ctx)
	}
	return t.firstErr
}

var _ pgx.Tx = (*handlerTx)(nil)

// pgxHandle returns a pgx.Tx on the open transaction. Its BeginQuery begins nothing: the
// transaction is already open.
func (t *handlerTx) pgxHandle(ctx context.Context) (pgx.Tx, error) {
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
func (t *handlerTx) Begin(ctx context.Context) (pgx.Tx, error) {
	h, err := t.pgxHandle(ctx)
	if err != nil {
		return nil, err
	}
	return h.Begin(ctx)
}

// Commit returns an error: DoTx commits.
func (t *handlerTx) Commit(context.Context) error { return errHandlerEndsTx }

// Rollback returns an error: DoTx rolls back when the handler returns an error.
func (t *handlerTx) Rollback(context.Context) error { return errHandlerEndsTx }

func (t *handlerTx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	defer t.since(time.Now())
	if err := t.use(ctx); err != nil {
		return 0, err
	}
	return t.conn.CopyFrom(ctx, tableName, columnNames, rowSrc)
}

func (t *handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	defer t.since(time.Now())
	if err := t.use(ctx); err != nil {
		return errBatchResults{err}
	}
	return timedBatch{t.conn.SendBatch(ctx, b), t}
}

// LargeObjects returns the large object API on the transaction. The first call (or
// Begin) costs a round trip, bounded by 10 seconds. pgx.LargeObjects can only be made by
// pgx, and this method cannot return an error: if that round trip fails (the connection
// is broken), it panics with the error, and DoTx rolls back and panics again.
func (t *handlerTx) LargeObjects() pgx.LargeObjects {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	h, err := t.pgxHandle(ctx)
	if err != nil {
		panic(fmt.Errorf("idempotency: DoTx large objects: %w", err))
	}
	return h.LargeObjects()
}

func (t *handlerTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	defer t.since(time.Now())
	if err := t.use(ctx); err != nil {
		return nil, err
	}
	return t.conn.Prepare(ctx, name, sql)
}

func (t *handlerTx) Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error) {
	defer t.since(time.Now())
	if err := t.use(ctx); err != nil {
		return pgconn.CommandTag{}, err
	}
	return t.conn.Exec(ctx, sql, arguments...)
}

func (t *handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	defer t.since(time.Now())
	if err := t.use(ctx); err != nil {
		return nil, err
	}
	rows, err := t.conn.Query(ctx, sql, args...)
	if err != nil {
		return rows, err
	}
	return &timedRows{Rows: rows, t: t}, nil
}

func (t *handlerTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	defer t.since(time.Now())
	if err := t.use(ctx); err != nil {
		return errRow{err}
	}
	return timedRow{t.conn.QueryRow(ctx, sql, args...), t}
}

// timedRows counts the time its rows take to arrive (Next) and to close in InDB.
type timedRows struct {
	pgx.Rows
	t *handlerTx
}

func (r *timedRows) Next() bool {
	defer r.t.since(time.Now())
	return r.Rows.Next()
}

func (r *timedRows) Close() {
	defer r.t.since(time.Now())
	r.Rows.Close()
}

// timedRow counts the time its row takes to arrive (Scan) in InDB.
type timedRow struct {
	pgx.Row
	t *handlerTx
}

func (r timedRow) Scan(dest ...any) error {
	defer r.t.since(time.Now())
	return r.Row.Scan(dest...)
}

// timedBatch counts the time its results take to arrive in InDB.
type timedBatch struct {
	pgx.BatchResults
	t *handlerTx
}

func (b timedBatch) Exec() (pgconn.CommandTag, error) {
	defer b.t.since(time.Now())
	return b.BatchResults.Exec()
}

func (b timedBatch) Query() (pgx.Rows, error) {
	defer b.t.since(time.Now())
	rows, err := b.BatchResults.Query()
	if err != nil {
		return rows, err
	}
	return &timedRows{Rows: rows, t: b.t}, nil
}

func (b timedBatch) QueryRow() pgx.Row {
	defer b.t.since(time.Now())
	return timedRow{b.BatchResults.QueryRow(), b.t}
}

func (b timedBatch) Close() error {
	defer b.t.since(time.Now())
	return b.BatchResults.Close()
}

func (t *handlerTx) Conn() *pgx.Conn { return t.conn }

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
