package store

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// A DoTx transaction writes each of its members' rows once, at its end. Its first round
// trip holds the keys and reads their rows (BeginClaims): a transaction-scoped advisory
// lock on a 64-bit hash of each key, taken by one statement, is what keeps two
// transactions off one key while their handlers run (it writes no WAL and ends with the
// transaction, behind a transaction-mode pooler too); the next statement, whose snapshot
// is taken after the locks, reads each key's row and draws a fence for each key it may
// take. The handlers run. The last statement (FinishAndCommit) writes every taken key's
// row, completed or failed, re-checking on the newest row version what the read assumed,
// and fails unless it wrote them all, so that the COMMIT sent after it cannot commit
// handlers' effects without their rows.

// The statements that frame a DoTx transaction. With several members, each may run in a
// savepoint of its own, released when it succeeds and rolled back when it does not; one
// name serves all, as the previous member's savepoint is gone before the next one is made.
var (
	beginSQL = sqlText("begin", nil) // begin.sql
	// savepointSQL opens a member's savepoint; releaseSQL ends it, keeping the member's
	// work (savepoint.sql, release_savepoint.sql).
	savepointSQL = sqlText("savepoint", nil)
	releaseSQL   = sqlText("release_savepoint", nil)
	// undoSQL rolls a failed member's work back and ends its savepoint (undo.sql).
	undoSQL = sqlText("undo", nil)
)

// A member's savepoint costs no round trip of its own: its opening and its release ride
// the transaction's next one, as statements sent before it (the pre of OpenSavepoint,
// CheckResult and FinishAndCommit).

// WithSavepoint returns pre followed by the opening of a member's savepoint.
func WithSavepoint(pre []string) []string { return append(pre, savepointSQL) }

// WithRelease returns pre followed by the release of a member's savepoint, which keeps
// the member's work.
func WithRelease(pre []string) []string { return append(pre, releaseSQL) }

// OpenSavepoint sends pre and opens a member's savepoint, in one round trip: when the
// member's handler first uses the transaction.
func OpenSavepoint(ctx context.Context, conn *pgx.Conn, pre []string) error {
	return Exec(ctx, conn, WithSavepoint(pre)...)
}

// UndoSavepoint rolls a failed member's work back and ends its savepoint. It runs alone,
// in the simple protocol, which an aborted transaction accepts.
func UndoSavepoint(ctx context.Context, conn *pgx.Conn) error {
	_, err := conn.Exec(ctx, undoSQL)
	return err
}

// readKeysSQL reads the row of each key of a DoTx transaction, after HoldKeys
// (read_keys.sql).
var readKeysSQL = sqlText("read_keys", nil)

// TxClaims is what BeginClaims learned: the transaction's id and the server's start time,
// and each key's row (indexed like the params).
type TxClaims struct {
	XID, ServerStart string
	Rows             []ClaimRow
}

// BeginClaims begins a transaction on conn and holds and reads the keys of ps in it (see
// hold_keys.sql, read_keys.sql), in one round trip of three statements. A row whose
// Claimed is set was taken: its Fence is the claim's and Attempts its attempt. One whose
// Attempted is set is held by another transaction. idle is the transaction's
// idle_in_transaction_session_timeout, as "30000ms". With wait and one key, the key's
// lock is waited for, up to lockTimeout (as "2000ms"): a lock timeout (SQLSTATE 55P03)
// refuses the round trip. An error the server answered leaves the transaction open,
// aborted.
func (w *Writes) BeginClaims(ctx context.Context, conn *pgx.Conn, idle, lockTimeout string, wait bool, ps []ClaimParams, maxAge time.Duration) (TxClaims, error) {
	keys, fps := make([]string, len(ps)), make([][]byte, len(ps))
	for i, p := range ps {
		keys[i], fps[i] = p.Key, p.Fingerprint
	}
	batch := &pgx.Batch{}
	batch.Queue(beginSQL)
	hold := w.HoldKeys
	if wait && len(ps) == 1 {
		hold = w.HoldKeyWait
	}
	batch.Queue(hold, lockTimeout, keys, idle)
	batch.Queue(readKeysSQL, keys, maxAge.Microseconds(), fps)
	br := conn.SendBatch(ctx, batch)
	t := TxClaims{Rows: make([]ClaimRow, len(ps))}
	_, err := br.Exec()
	if err == nil {
		t.XID, t.ServerStart, err = lastTwo(br)
	}
	if err == nil {
		var rs pgx.Rows
		rs, err = br.Query()
		n := 0
		for err == nil && rs.Next() {
			var ord int
			var r ClaimRow
			if err = rs.Scan(r.targets(&ord)...); err == nil && ord != n+1 {
				err = fmt.Errorf("answer for row %d of %d", ord, len(ps))
			}
			if err == nil {
				t.Rows[n], n = r, n+1
			}
		}
		if rs != nil {
			rs.Close()
			if err == nil {
				err = rs.Err()
			}
		}
		if err == nil && n != len(ps) {
			err = fmt.Errorf("%d answers for %d keys", n, len(ps))
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return t, err
}

// lastTwo reads HoldKeys' answer: of its one row (the settings it made, then the
// transaction id and the server's start time, both text), the last two columns.
func lastTwo(br pgx.BatchResults) (xid, start string, err error) {
	rs, err := br.Query()
	if err != nil {
		return "", "", err
	}
	defer rs.Close()
	if !rs.Next() {
		if err := rs.Err(); err != nil {
			return "", "", err
		}
		return "", "", errors.New("hold keys: no row")
	}
	vals := rs.RawValues()
	if len(vals) < 2 {
		return "", "", fmt.Errorf("hold keys: %d columns", len(vals))
	}
	xid, start = string(vals[len(vals)-2]), string(vals[len(vals)-1])
	rs.Close()
	return xid, start, rs.Err()
}

// checkResultSQL has the server parse a result as jsonb (check_result.sql).
var checkResultSQL = sqlText("check_result", nil)

// CheckResult runs pre, then has the server parse result as jsonb, in one round trip: a
// member run in a savepoint learns there, while its savepoint can still undo it alone,
// whether the finish will take its result. A value jsonb refuses fails with a data
// exception (class 22).
func CheckResult(ctx context.Context, conn *pgx.Conn, pre []string, result string) error {
	batch := &pgx.Batch{}
	for _, s := range pre {
		batch.Queue(s)
	}
	batch.Queue(checkResultSQL, result)
	return conn.SendBatch(ctx, batch).Close()
}

// FinishAndCommit runs pre (a savepoint's release), writes every row of ps in one
// statement (FinishTx, which fails unless it wrote them all) and commits, in one round
// trip; lockTimeout bounds its wait for a row another session holds, as "2000ms". A
// COMMIT that answers anything but COMMIT (an aborted transaction answers ROLLBACK) is an
// error. The statement's refusal because a row was not what the read found is one for
// which Conflict reports true.
//
// events, if any, ride the same round trip after the COMMIT, in a transaction of their
// own (see finishWithEvents): their statement cannot undo the commit, waits at most
// EventsLockTimeout for the table, and its error (eventsErr) is not the commit's.
func (w *Writes) FinishAndCommit(ctx context.Context, conn *pgx.Conn, pre []string, lockTimeout string, ps []FinishParams, events []EventParams) (eventsErr, err error) {
	if len(events) > 0 {
		return w.finishWithEvents(ctx, conn, pre, lockTimeout, ps, events)
	}
	batch := &pgx.Batch{}
	for _, s := range pre {
		batch.Queue(s)
	}
	batch.Queue(claimSettingsSQL, lockTimeout) // the bound on its row-lock waits, its plans
	batch.Queue(w.FinishTx, finishTxArgs(ps)...)
	batch.Queue("COMMIT")
	return sendCommit(ctx, conn, batch, 0)
}

// stmtName names a prepared statement of sql: prefix and a hash of sql, so that each
// variant of a statement has a name of its own on a connection.
func stmtName(prefix, sql string) string {
	h := fnv.New64a()
	h.Write([]byte(sql))
	return prefix + strconv.FormatUint(h.Sum64(), 36)
}

// finishTxOIDs are FinishTx's parameter types.
var finishTxOIDs = []uint32{pgtype.TextArrayOID, pgtype.TextArrayOID, pgtype.Int8ArrayOID, pgtype.UUIDArrayOID,
	pgtype.ByteaArrayOID, pgtype.TextArrayOID, pgtype.TextArrayOID, pgtype.TextArrayOID, pgtype.Int4ArrayOID,
	pgtype.Int4ArrayOID, pgtype.TextArrayOID, pgtype.ByteaArrayOID, pgtype.BoolArrayOID}

// finishWithEvents is FinishAndCommit with events, sent on the protocol's pipeline rather
// than as a pgx batch: a batch would first prepare (or describe) the events statement on a
// connection that has not sent it yet, inside the caller's transaction, and that takes
// processed_job_events' lock with no bound (a VACUUM FULL would hold the finish until it
// ends, and a failure would abort the transaction). Here every statement goes unnamed with
// fixed parameter types, and the events' statement is parsed only in their own
// transaction, after the COMMIT and a Sync, under EventsLockTimeout. The round trip is
// the same.
func (w *Writes) finishWithEvents(ctx context.Context, conn *pgx.Conn, pre []string, lockTimeout string, ps []FinishParams, events []EventParams) (eventsErr, err error) {
	m := conn.TypeMap()
	params, formats, err := encodeArgs(m, finishTxOIDs, finishTxArgs(ps))
	if err != nil {
		return nil, err
	}
	// Where the pool prepares statements, the finish goes as a named statement too
	// (prepared once per connection; processed_jobs, not the history), so that it is not
	// planned again for each finish that carries events.
	var settings, finish *pgconn.StatementDescription
	if conn.Config().DefaultQueryExecMode == pgx.QueryExecModeCacheStatement {
		if settings, err = conn.Prepare(ctx, stmtName("idemq_settings_", claimSettingsSQL), claimSettingsSQL); err != nil {
			return nil, err
		}
		if finish, err = conn.Prepare(ctx, stmtName("idemq_finish_tx_", w.FinishTx), w.FinishTx); err != nil {
			return nil, err
		}
	}
	pipe := conn.PgConn().StartPipeline(ctx)
	defer pipe.Close()
	for _, s := range pre {
		pipe.SendQueryParams(s, nil, nil, nil, nil)
	}
	if finish != nil {
		pipe.SendQueryStatement(settings, [][]byte{[]byte(lockTimeout)}, nil, nil)
		pipe.SendQueryStatement(finish, params, formats, nil)
	} else {
		pipe.SendQueryParams(claimSettingsSQL, [][]byte{[]byte(lockTimeout)}, []uint32{pgtype.TextOID}, nil, nil)
		pipe.SendQueryParams(w.FinishTx, params, finishTxOIDs, formats, nil)
	}
	pipe.SendQueryParams("COMMIT", nil, nil, nil, nil)
	pipe.SendPipelineSync()
	if err := queueEvents(pipe, m, events); err != nil {
		return nil, err
	}
	if err := pipe.Sync(); err != nil {
		return nil, err
	}
	var tag pgconn.CommandTag
	for range len(pre) + 3 {
		res, rerr := pipe.GetResults()
		if rerr != nil {
			err = rerr
			break
		}
		rr, ok := res.(*pgconn.ResultReader)
		if !ok {
			err = fmt.Errorf("unexpected pipeline result %T", res)
			break
		}
		if tag, err = rr.Close(); err != nil {
			break
		}
	}
	if err == nil && tag.String() != "COMMIT" {
		err = fmt.Errorf("commit answered %q", tag.String())
	}
	if err != nil {
		// The server skipped the rest up to the Sync; the events' transaction runs
		// after it, in the aborted transaction or a new one: they count as not written.
		return err, err
	}
	if _, err := pipe.GetResults(); err != nil { // the Sync after the COMMIT
		return err, err
	}
	return readEvents(pipe), nil
}

// finishTxArgs returns FinishTx's arguments for ps.
func finishTxArgs(ps []FinishParams) []any {
	n := len(ps)
	keys, types, fences, owners := make([]string, n), make([]string, n), make([]int64, n), make([]pgtype.UUID, n)
	fps, statuses, results, errs := make([][]byte, n), make([]string, n), make([]pgtype.Text, n), make([]pgtype.Text, n)
	attempts, gens, traces, sums := make([]int32, n), make([]int32, n), make([]pgtype.Text, n), make([][]byte, n)
	found := make([]bool, n)
	for i, p := range ps {
		keys[i], types[i], fences[i], owners[i], fps[i] = p.Key, p.TaskType, p.Fence, p.Owner, p.Fingerprint
		statuses[i] = StatusCompleted
		if p.Action == ActionFail {
			statuses[i] = StatusFailed
		}
		results[i], errs[i], attempts[i], gens[i] = p.Result, p.Error, int32(p.Attempt), int32(p.Generation)
		traces[i] = pgtype.Text{String: p.TraceID, Valid: p.TraceID != ""}
		sums[i], found[i] = p.IntentSum, p.Found
	}
	return []any{keys, types, fences, owners, fps, statuses, results, errs, attempts, gens, traces, sums, found}
}

// Conflict reports whether err is the refusal of a DoTx finish that found a row other
// than its read did: the guard's division by zero, or a row where the read found none.
func Conflict(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == DivisionByZero ||
		pgErr.Code == UniqueViolation && pgErr.ConstraintName == "processed_jobs_pkey")
}

// Exec runs plain statements (no arguments) in one round trip.
func Exec(ctx context.Context, conn *pgx.Conn, stmts ...string) error {
	if len(stmts) == 0 {
		return nil
	}
	batch := &pgx.Batch{}
	for _, s := range stmts {
		batch.Queue(s)
	}
	return conn.SendBatch(ctx, batch).Close()
}

// sendCommit sends batch, whose statements up to the last after ones end with a COMMIT,
// and checks that it committed (err); the after statements run once it did, and their
// error is afterErr.
func sendCommit(ctx context.Context, conn *pgx.Conn, batch *pgx.Batch, after int) (afterErr, err error) {
	br := conn.SendBatch(ctx, batch)
	var tag pgconn.CommandTag
	for range batch.Len() - after {
		if tag, err = br.Exec(); err != nil {
			break
		}
	}
	if err == nil && tag.String() != "COMMIT" {
		err = fmt.Errorf("commit answered %q", tag.String())
	}
	if err == nil {
		for range after {
			if _, afterErr = br.Exec(); afterErr != nil {
				break
			}
		}
	}
	if cerr := br.Close(); err == nil && afterErr == nil {
		err = cerr
	}
	if err != nil && after > 0 && afterErr == nil {
		afterErr = err // not reached
	}
	return afterErr, err
}

// Rollback ends conn's transaction, if one is open, or closes conn when it cannot.
func Rollback(ctx context.Context, conn *pgx.Conn) {
	if conn.IsClosed() || conn.PgConn().TxStatus() == 'I' {
		return
	}
	if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
		conn.PgConn().Close(ctx) // closing the connection rolls back too
	}
}

// Answered reports whether err came from the server (which then committed nothing).
func Answered(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr)
}
