package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// The database/sql form of a DoTx transaction (DoSQLTx): the same statements as
// BeginClaims and FinishAndCommit, sent one at a time (database/sql has no pipeline), on a
// *sql.Tx of pgx's stdlib or lib/pq. Arrays go as their text form ('{"a","b"}'), which
// both drivers send as text for the statements' casts to read, and a server's error comes
// back as a *pgconn.PgError whichever driver answered, so that the ledger reads it as it
// reads pgx's.

// SQLDriver names the database/sql drivers DoSQLTx runs on.
type SQLDriver string

const (
	DriverPgx SQLDriver = "pgx" // github.com/jackc/pgx/v5/stdlib
	DriverPq  SQLDriver = "pq"  // github.com/lib/pq
)

// SQLDriverOf tells which driver db runs on, from its driver's Go type, or refuses it with
// a message naming that type and the two that are supported.
func SQLDriverOf(db *sql.DB) (SQLDriver, error) {
	t := reflect.TypeOf(db.Driver())
	name := fmt.Sprint(t)
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch {
	case t != nil && t.PkgPath() == "github.com/jackc/pgx/v5/stdlib":
		return DriverPgx, nil
	case t != nil && t.PkgPath() == "github.com/lib/pq":
		return DriverPq, nil
	}
	return "", fmt.Errorf("database/sql driver %s is not supported: use github.com/jackc/pgx/v5/stdlib (*stdlib.Driver) or github.com/lib/pq (*pq.Driver)", name)
}

// BeginClaimSQL begins a transaction on db and holds and reads p's key in it, waiting for
// the key's lock up to lockTimeout (hold_keys.sql, read_keys.sql): three round trips,
// each bounded by ctx. The transaction lives until txCtx ends (database/sql then rolls it
// back, or cuts its COMMIT) or the caller ends it. idle is the transaction's
// idle_in_transaction_session_timeout. On an error the transaction is rolled back.
func (w *Writes) BeginClaimSQL(ctx, txCtx context.Context, db *sql.DB, idle, lockTimeout string, p ClaimParams, maxAge time.Duration) (*sql.Tx, TxClaims, error) {
	var t TxClaims
	tx, err := db.BeginTx(txCtx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return nil, t, SQLError(err)
	}
	fail := func(err error) (*sql.Tx, TxClaims, error) {
		_ = tx.Rollback()
		return nil, t, SQLError(err)
	}
	a, err := textArgs([]uint32{pgtype.TextArrayOID, pgtype.ByteaArrayOID}, []any{[]string{p.Key}, [][]byte{p.Fingerprint}})
	if err != nil {
		return fail(err)
	}
	keys, fps := a[0], a[1]
	if t.XID, t.ServerStart, err = lastTwoSQL(ctx, tx, w.HoldKeyWait, lockTimeout, keys, idle); err != nil {
		return fail(err)
	}
	var r ClaimRow
	var ord int
	targets := sqlTargets(r.targets(&ord))
	if err := tx.QueryRowContext(ctx, readKeysSQL, keys, maxAge.Microseconds(), fps).Scan(targets...); err != nil {
		return fail(err)
	}
	t.Rows = []ClaimRow{r}
	return tx, t, nil
}

// lastTwoSQL runs the hold statement and returns the last two columns of its one row.
func lastTwoSQL(ctx context.Context, tx *sql.Tx, query string, args ...any) (xid, start string, err error) {
	rows, err := tx.QueryContext(ctx, query, args...)
	if err != nil {
		return "", "", err
	}
	defer rows.Close()
	cols, err := rows.Columns()
	if err != nil {
		return "", "", err
	}
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return "", "", err
		}
		return "", "", errors.New("hold keys: no row")
	}
	vals := make([]any, len(cols))
	for i := range vals {
		vals[i] = new(sql.NullString)
	}
	if err := rows.Scan(vals...); err != nil {
		return "", "", err
	}
	n := len(vals)
	return vals[n-2].(*sql.NullString).String, vals[n-1].(*sql.NullString).String, rows.Close()
}

// FinishSQL writes p's row (FinishTx, which fails unless it wrote it) and commits. commit
// is the COMMIT's own error, apart from the statements' before it: when it is set and
// Answered is false, the answer was lost (resolve it from the transaction id).
func (w *Writes) FinishSQL(ctx context.Context, tx *sql.Tx, lockTimeout string, p FinishParams) (err error, commit error) {
	args, err := textArgs(finishTxOIDs, finishTxArgs([]FinishParams{p}))
	if err != nil {
		return SQLError(err), nil
	}
	if _, err := tx.ExecContext(ctx, claimSettingsSQL, lockTimeout); err != nil {
		return SQLError(err), nil
	}
	var guard sql.NullString
	if err := tx.QueryRowContext(ctx, w.FinishTx, args...).Scan(&guard); err != nil {
		return SQLError(err), nil
	}
	if err := tx.Commit(); err != nil {
		return nil, SQLError(err)
	}
	return nil, nil
}

// textMaps encode arguments to their text form: a pgx type map caches its plans, so each
// goroutine takes one of its own.
var textMaps = sync.Pool{New: func() any { return pgtype.NewMap() }}

// textArgs is args, of the parameter types oids, each in Postgres's text form (a string):
// what the database/sql statements send, taken alike by pgx's stdlib and lib/pq.
func textArgs(oids []uint32, args []any) ([]any, error) {
	m := textMaps.Get().(*pgtype.Map)
	defer textMaps.Put(m)
	params, err := encode(m, pgtype.TextFormatCode, oids, args)
	if err != nil {
		return nil, err
	}
	out := make([]any, len(params))
	for i, b := range params {
		out[i] = string(b)
	}
	return out, nil
}

// sqlTargets adapts scan targets to database/sql: a column that lib/pq hands over as
// bytes (a uuid, say) reaches a pgtype target as text, and a column read for nothing
// (a nil target) is discarded.
func sqlTargets(targets []any) []any {
	out := make([]any, len(targets))
	for i, t := range targets {
		switch t := t.(type) {
		case nil:
			out[i] = new(any)
		case sql.Scanner:
			out[i] = textScanner{t}
		default:
			out[i] = t
		}
	}
	return out
}

type textScanner struct{ sql.Scanner }

func (s textScanner) Scan(src any) error {
	if b, ok := src.([]byte); ok {
		src = string(b)
	}
	return s.Scanner.Scan(src)
}

// SQLError returns err, a database/sql driver's, with a server's error as a
// *pgconn.PgError (pgx's stdlib answers one already; lib/pq's *pq.Error is read through
// its methods), so that IsCode, Conflict and Answered read it.
func SQLError(err error) error {
	var pe *pgconn.PgError
	if err == nil || errors.As(err, &pe) {
		return err
	}
	var state interface{ SQLState() string }
	if !errors.As(err, &state) || state.SQLState() == "" {
		return err
	}
	pe = &pgconn.PgError{Code: state.SQLState(), Message: err.Error()}
	if f, ok := state.(interface{ Get(byte) string }); ok {
		pe.Severity, pe.Message, pe.Detail, pe.ConstraintName = f.Get('S'), f.Get('M'), f.Get('D'), f.Get('n')
	}
	return pe
}

// HoldStepDB is HoldStep on a database/sql transaction (StepSQLTx).
func (w *Writes) HoldStepDB(ctx context.Context, tx *sql.Tx, p StepParams) (held bool, err error) {
	rows, err := tx.QueryContext(ctx, w.HoldStepSQL, p.Key, p.Fence, p.Owner, p.Generation)
	if err != nil {
		return false, SQLError(err)
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		n++
	}
	return n == 1, SQLError(rows.Err())
}

// InsertStepDB is InsertStep on a database/sql transaction (StepSQLTx).
func (w *Writes) InsertStepDB(ctx context.Context, tx *sql.Tx, p StepParams) error {
	var input any // NULL for none, whatever the driver makes of a nil slice
	if p.InputFingerprint != nil {
		input = p.InputFingerprint
	}
	_, err := tx.ExecContext(ctx, w.InsertStepSQL, p.Key, p.Generation, p.Step, p.Seq, p.Fence, input, p.Result)
	return SQLError(err)
}

// InsertIntentsDB is InsertIntents on a database/sql transaction (EnqueueSQLTx).
func InsertIntentsDB(ctx context.Context, tx *sql.Tx, ps []IntentParams, hold time.Duration) (map[string]string, error) {
	args, err := textArgs(intentOIDs, intentArgs(ps))
	if err != nil {
		return nil, err
	}
	rows, err := tx.QueryContext(ctx, insertIntentsSQL, append(args, hold.Milliseconds())...)
	if err != nil {
		return nil, SQLError(err)
	}
	defer rows.Close()
	inserted := make(map[string]string, len(ps))
	for rows.Next() {
		var key, state string
		if err := rows.Scan(&key, &state); err != nil {
			return nil, err
		}
		inserted[key] = state
	}
	return inserted, SQLError(rows.Err())
}

// ReadIntentsDB is ReadIntents on a database/sql transaction (EnqueueSQLTx).
func ReadIntentsDB(ctx context.Context, tx *sql.Tx, keys []string) (map[string]RecordedIntent, error) {
	arr, err := textArgs([]uint32{pgtype.TextArrayOID}, []any{keys})
	if err != nil {
		return nil, err
	}
	rows, err := tx.QueryContext(ctx, readIntentsSQL, arr[0])
	if err != nil {
		return nil, SQLError(err)
	}
	defer rows.Close()
	known := make(map[string]RecordedIntent, len(keys))
	for rows.Next() {
		var key string
		var r RecordedIntent
		if err := rows.Scan(&key, &r.TaskType, &r.Fingerprint, &r.State); err != nil {
			return nil, err
		}
		known[key] = r
	}
	return known, SQLError(rows.Err())
}
