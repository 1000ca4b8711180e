package api

import (
	"context"
	"fmt"
	"time"

	"github.com/idemq/idemq/idempotency/outbox"
)

// PurgeKeys deletes the remembered Idempotency-Key rows created longer ago than olderThan,
// in batches (outbox.PurgeRequestKeys), and returns how many it deleted. A key repeated after that is a new request:
// its job key still dedups it (200, not a replay). Safe to run on every replica.
func (s *Server) PurgeKeys(ctx context.Context, olderThan time.Duration) (int64, error) {
	n, err := outbox.PurgeRequestKeys(ctx, s.deps.Pool, olderThan)
	if err != nil {
		return n, fmt.Errorf("api: purge Idempotency-Key rows: %w", err)
	}
	return n, nil
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
