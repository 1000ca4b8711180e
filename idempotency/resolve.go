package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

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
// answer is certain or ctx ends. A retryable Fail leaves the row in progress, so after a
// restart it reads as not committed (harmless: the lease then ends by itself).
func (l *Ledger) resolveXact(ctx context.Context, c *Claim) (bool, error) {
	wait := 20 * time.Millisecond
	var lastErr error
	for {
		var status pgtype.Text
		var sameServer, landed bool
		err := l.pool.QueryRow(ctx, store.XactStatusSQL, c.xid, c.serverStart, c.Key, c.Fence, c.owner).Scan(&status, &sameServer, &landed)
		switch {
		case err == nil && !sameServer:
			return landed, nil
		case err == nil && status.String == "committed":
			return true, nil
		case err == nil && status.String == "aborted":
			return false, nil
		case err == nil && !status.Valid:
			return false, fmt.Errorf("transaction %s is unknown to the server (too old)", c.xid)
		case err != nil:
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
		wait = min(2*wait, time.Second)
	}
}
