package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// The statements that frame a shared DoTx transaction. Each member runs in a savepoint of
// its own, released when it succeeds and rolled back when it does not; one name serves
// all, as the previous member's savepoint is gone before the next one is made.
const (
	beginSQL = "BEGIN ISOLATION LEVEL READ COMMITTED"
	// Savepoint opens a member's savepoint; Release ends it, keeping the member's work.
	Savepoint = "SAVEPOINT idemq_member"
	Release   = "RELEASE SAVEPOINT idemq_member"
	// Undo rolls a failed member's work back and ends its savepoint. It runs alone, in the
	// simple protocol, which an aborted transaction accepts.
	Undo = "ROLLBACK TO SAVEPOINT idemq_member; " + Release
)

// txClaimSettingsSQL is claimSettingsSQL ($1 the lock timeout) that also bounds how long
// the transaction may sit idle ($2, as "30000ms") and draws its id, for a COMMIT whose
// answer is lost: its last two columns.
const txClaimSettingsSQL = claimSettingsSQL + `,
	       set_config('idle_in_transaction_session_timeout', $2, true), pg_current_xact_id()::text, pg_postmaster_start_time()::text`

// TxClaims is what BeginClaims learned: the transaction's id and the server's start time,
// and each key's row (indexed like the params; Answered false when none came back).
type TxClaims struct {
	XID, ServerStart string
	Rows             []ClaimRow
	Answered         []bool
}

// BeginClaims begins a transaction on conn and claims ps in it (written completed: the
// row lock is the lease until the COMMIT), in one round trip of three statements: BEGIN,
// the settings, the claim (which puts the settings back). idle is the transaction's
// idle_in_transaction_session_timeout and lockTimeout the bound on the claims' row-lock
// waits, as "2000ms". An error the server answered leaves the transaction open, aborted.
func BeginClaims(ctx context.Context, conn *pgx.Conn, idle, lockTimeout string, ps []ClaimParams, maxAge time.Duration) (TxClaims, error) {
	batch := &pgx.Batch{}
	batch.Queue(beginSQL)
	batch.Queue(txClaimSettingsSQL, lockTimeout, idle)
	batch.Queue(claimManySQL, ClaimArgs(ps, maxAge, true)...)
	br := conn.SendBatch(ctx, batch)
	t := TxClaims{Rows: make([]ClaimRow, len(ps)), Answered: make([]bool, len(ps))}
	_, err := br.Exec()
	if err == nil {
		err = br.QueryRow().Scan(nil, nil, nil, nil, nil, nil, nil, &t.XID, &t.ServerStart)
	}
	if err == nil {
		var rs pgx.Rows
		rs, err = br.Query()
		for err == nil && rs.Next() {
			var ord int
			var r ClaimRow
			if err = rs.Scan(r.targets(&ord)...); err == nil && (ord < 1 || ord > len(ps)) {
				err = fmt.Errorf("answer for row %d of %d", ord, len(ps))
			}
			if err == nil {
				t.Rows[ord-1], t.Answered[ord-1] = r, true
			}
		}
		if rs != nil {
			rs.Close()
			if err == nil {
				err = rs.Err()
			}
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return t, err
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

// StoredResult is a DoTx result to store, fenced, on the row its claim wrote completed.
type StoredResult struct {
	Finish        FinishParams // the claim (Key, Fence, Owner)
	Result, Error pgtype.Text  // NULL when not valid
}

// textArg is t as a statement argument of any type (jsonb, text): its string, or NULL.
func textArg(t pgtype.Text) any {
	if !t.Valid {
		return nil
	}
	return t.String
}

// StoreResult runs pre, then stores r, in one round trip. The statement fails with
// SQLSTATE 22012 (division by zero) when the claim no longer holds the row; a value jsonb
// refuses fails with a data exception (class 22).
func (w *Writes) StoreResult(ctx context.Context, conn *pgx.Conn, pre []string, r StoredResult) error {
	batch := &pgx.Batch{}
	for _, s := range pre {
		batch.Queue(s)
	}
	batch.Queue(w.StoreResultTx, r.Finish.Key, r.Finish.Fence, r.Finish.Owner, textArg(r.Result), textArg(r.Error), r.Finish.IntentSum)
	return conn.SendBatch(ctx, batch).Close()
}

// StoreAndCommit stores the result of a transaction's only member and commits, in one
// round trip: StoreResultTx does all that FinishTxMany would for a completion (the fence
// check, the outbox intent), and nothing else is left to end. A COMMIT that answers
// anything but COMMIT (an aborted transaction answers ROLLBACK) is an error.
func (w *Writes) StoreAndCommit(ctx context.Context, conn *pgx.Conn, r StoredResult) error {
	batch := &pgx.Batch{}
	batch.Queue(w.StoreResultTx, r.Finish.Key, r.Finish.Fence, r.Finish.Owner, textArg(r.Result), textArg(r.Error), r.Finish.IntentSum)
	batch.Queue("COMMIT")
	return sendCommit(ctx, conn, batch)
}

// FinishAndCommit runs pre, ends every row of ps in one statement (FinishTxMany, which
// fails unless every completed or failed row is still held) and commits, in one round
// trip. A COMMIT that answers anything but COMMIT (an
// aborted transaction answers ROLLBACK) is an error.
func (w *Writes) FinishAndCommit(ctx context.Context, conn *pgx.Conn, pre []string, ps []FinishParams) error {
	batch := &pgx.Batch{}
	for _, s := range pre {
		batch.Queue(s)
	}
	batch.Queue(keyPlansSQL)
	batch.Queue(w.FinishTxMany, finishTxArgs(ps)...)
	batch.Queue("COMMIT")
	return sendCommit(ctx, conn, batch)
}

// sendCommit sends batch, which ends with a COMMIT, and checks that it committed.
func sendCommit(ctx context.Context, conn *pgx.Conn, batch *pgx.Batch) error {
	br := conn.SendBatch(ctx, batch)
	var err error
	var tag pgconn.CommandTag
	for range batch.Len() {
		if tag, err = br.Exec(); err != nil {
			break
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil && tag.String() != "COMMIT" {
		err = fmt.Errorf("commit answered %q", tag.String())
	}
	return err
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
