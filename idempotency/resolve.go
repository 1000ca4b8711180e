package idempotency

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemq/idemq/idempotency/internal/store"
)

// commitLost decides what a failed COMMIT of c's fenced write did, from the transaction
// id taken before the COMMIT was sent.
func (l *Ledger) commitLost(ctx context.Context, c *Claim, cerr error) error {
	xid := c.xid
	var pgErr *pgconn.PgError
	if errors.As(cerr, &pgErr) {
		// The server answered: the transaction did not commit.
		return fmt.Errorf("idempotency: commit %s: %w", c.Key, cerr)
	}
	committed, err := l.resolveXact(ctx, c)
	if err != nil {
		// The connection was lost and no other reached the server in time.
		l.observe(EventCommitUnknown, c.TaskType)
		return &unavailableError{err: fmt.Errorf("%w: key %q xid %s: %v (commit: %v)", ErrCommitUnknown, c.Key, xid, err, cerr)}
	}
	l.observe(EventCommitResolved, c.TaskType)
	l.log.WarnContext(ctx, "idempotency: commit outcome resolved by transaction id", "task_type", c.TaskType, "key", c.Key, "fence", c.Fence, "xid", xid, "committed", committed)
	if !committed {
		return fmt.Errorf("idempotency: commit %s aborted: %w", c.Key, cerr)
	}
	return nil
}

// resolveXact asks, on fresh connections, whether c's transaction committed, until the
// answer is certain or ctx ends (store.AwaitXact). A retryable Fail leaves the row in
// progress, so after a restart it reads as not committed (harmless: the lease then ends
// by itself).
func (l *Ledger) resolveXact(ctx context.Context, c *Claim) (bool, error) {
	return store.AwaitXact(ctx, func(ctx context.Context) (committed, done bool, err error) {
		var status pgtype.Text
		var sameServer, landed bool
		if err := l.pool.QueryRow(ctx, store.XactStatusSQL, c.xid, c.serverStart, c.Key, c.Fence, c.owner).Scan(&status, &sameServer, &landed); err != nil {
			return false, false, err
		}
		switch {
		case !sameServer: // no transaction from before a restart can still commit: the row tells
			return landed, true, nil
		case !status.Valid:
			return false, true, fmt.Errorf("transaction %s is unknown to the server (too old)", c.xid)
		}
		return status.String == "committed", status.String != "in progress", nil
	})
}
