package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A transaction whose COMMIT may lose its answer (the connection breaks after the COMMIT
// was sent): the server is asked, by transaction id, whether it committed, so that a
// caller never reports as done what did not commit, nor as failed what did.

// ErrCommitUnknown means a COMMIT lost its answer and the server could not say whether it
// committed (it restarted as another server, or stayed unreachable).
var ErrCommitUnknown = errors.New("commit outcome unknown")

// XactIDSQL reads a transaction's id and the server's start time, as XactID; send it
// inside the transaction (it assigns the id), pipelined with the first statements
// (xact_id.sql).
var XactIDSQL = sqlText("xact_id", nil)

// XactID names a transaction on one server run.
type XactID struct {
	Xid, ServerStart string
}

// resolveXactSQL is the fate of a transaction (resolve_xact.sql).
var resolveXactSQL = sqlText("resolve_xact", nil)

// CommitXact commits tx. When the server answered the COMMIT with an error, nothing
// committed. When the answer was lost, CommitXact asks the server on fresh connections
// from pool, for up to resolveFor, whether transaction id committed: nil if it did, an
// error if it aborted, and ErrCommitUnknown (wrapped) if that cannot be learned.
func CommitXact(ctx context.Context, tx pgx.Tx, pool *pgxpool.Pool, id XactID, resolveFor time.Duration) error {
	err := tx.Commit(ctx)
	var pgErr *pgconn.PgError
	if err == nil || errors.As(err, &pgErr) || id.Xid == "" {
		return err
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), resolveFor)
	defer cancel()
	committed, rerr := ResolveXact(rctx, pool, id)
	switch {
	case rerr != nil:
		return fmt.Errorf("%w: transaction %s: %v (commit: %v)", ErrCommitUnknown, id.Xid, rerr, err)
	case committed:
		return nil
	}
	return fmt.Errorf("commit: transaction %s aborted: %w", id.Xid, err)
}

// ResolveXact asks the server whether transaction id committed, again and again while it
// is still in progress or the server cannot be reached, until ctx ends.
func ResolveXact(ctx context.Context, pool *pgxpool.Pool, id XactID) (bool, error) {
	return AwaitXact(ctx, func(ctx context.Context) (committed, done bool, err error) {
		var status pgtype.Text
		var sameServer bool
		if err := pool.QueryRow(ctx, resolveXactSQL, id.Xid, id.ServerStart).Scan(&status, &sameServer); err != nil {
			return false, false, err
		}
		switch {
		case !sameServer:
			return false, true, errors.New("the server restarted as another run: its transaction ids are not this one's")
		case !status.Valid:
			return false, true, errors.New("the server no longer knows the transaction")
		}
		return status.String == "committed", status.String != "in progress", nil
	})
}

// AwaitXact is the one loop that learns a transaction's fate: it calls look until look
// says it is done (committed, or not, or an error that asking again cannot change),
// waiting 10 ms, then twice as long each time up to 500 ms, between looks. A look that is
// not done is asked again: the transaction is still in progress (err nil), or the server
// could not be asked (err, kept for the message). When ctx ends first, AwaitXact returns
// its cause with the last error.
func AwaitXact(ctx context.Context, look func(context.Context) (committed, done bool, err error)) (bool, error) {
	wait := 10 * time.Millisecond
	var lastErr error
	for {
		committed, done, err := look(ctx)
		if done {
			return committed, err
		}
		if err != nil {
			lastErr = err
		}
		select {
		case <-ctx.Done():
			if lastErr == nil {
				lastErr = errors.New("still in progress")
			}
			return false, fmt.Errorf("%w (last: %v)", context.Cause(ctx), lastErr)
		case <-time.After(wait):
		}
		wait = min(2*wait, 500*time.Millisecond)
	}
}
