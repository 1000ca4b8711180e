package api

import (
	"context"
	"fmt"
	"time"
)

// purgeKeysSQL deletes at most $2 Idempotency-Key rows older than $1 milliseconds.
const purgeKeysSQL = `DELETE FROM api_idempotency_keys WHERE ctid = ANY(ARRAY(
	SELECT ctid FROM api_idempotency_keys WHERE created_at < now() - $1 * interval '1 millisecond' LIMIT $2))`

// PurgeKeys deletes the remembered Idempotency-Key rows created longer ago than olderThan,
// in batches, and returns how many it deleted. A key repeated after that is a new request:
// its job key still dedups it (200, not a replay). Safe to run on every replica.
func (s *Server) PurgeKeys(ctx context.Context, olderThan time.Duration) (int64, error) {
	const batch = 1000
	var total int64
	for {
		tag, err := s.deps.Pool.Exec(ctx, purgeKeysSQL, olderThan.Milliseconds(), batch)
		if err != nil {
			return total, fmt.Errorf("api: purge Idempotency-Key rows: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < batch {
			return total, nil
		}
	}
}

// PurgeKeysEvery runs PurgeKeys(olderThan) every interval until ctx ends, logging errors.
func (s *Server) PurgeKeysEvery(ctx context.Context, interval, olderThan time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if n, err := s.PurgeKeys(ctx, olderThan); err != nil && ctx.Err() == nil {
			s.log.Warn("purge Idempotency-Key rows", "err", err)
		} else if n > 0 {
			s.log.Info("purged Idempotency-Key rows", "purged", n, "older_than", olderThan)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
