package api

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/metrics"
)

// purgeKeysTable is the table label of PurgeKeys's statements in the purge's metrics
// (idemq_purge_rows_total{table}).
const purgeKeysTable = "api_idempotency_keys"

// PurgeKeys deletes the remembered Idempotency-Key rows created longer ago than olderThan,
// in batches (outbox.PurgeRequestKeys), and returns how many it deleted. Each batch
// statement is reported to the purge's metrics (Metrics.ObservePurge, table
// api_idempotency_keys). A key repeated after that is a new request: its job key still dedups
// it (200, not a replay). Safe to run on every replica.
func (s *Server) PurgeKeys(ctx context.Context, olderThan time.Duration) (int64, error) {
	n, err := outbox.PurgeRequestKeys(ctx, observedPurge{s.deps.Pool, s.deps.Metrics}, olderThan)
	if err != nil {
		return n, fmt.Errorf("api: purge Idempotency-Key rows: %w", err)
	}
	return n, nil
}

// observedPurge runs outbox.PurgeRequestKeys's statements, one batch each, on pool and
// reports each to m.
type observedPurge struct {
	pool *pgxpool.Pool
	m    *metrics.Metrics
}

func (o observedPurge) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	began := time.Now()
	tag, err := o.pool.Exec(ctx, sql, args...)
	if err == nil {
		o.m.ObservePurge(purgeKeysTable, tag.RowsAffected(), time.Since(began))
	}
	return tag, err
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
