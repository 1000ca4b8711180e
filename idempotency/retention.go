package idempotency

import (
	"context"
	"errors"
	"log/slog"
	"time"
)

// RetentionConfig tunes RunRetention. The zero value of each field means its default.
type RetentionConfig struct {
	// OlderThan is the retention window: completed and failed rows that completed longer
	// ago are purged (see Purge). Required.
	OlderThan time.Duration
	// Every is how often a round may run. Default 1h.
	Every time.Duration
	// Turn, if set, is asked every minute (or Every, if shorter) whether this process
	// takes a round now; it should grant one round per Every across all replicas (for
	// example a Redis lock with a TTL of Every, taken and left to expire). Default: no
	// coordination, a round every Every.
	Turn func(ctx context.Context) bool
	// Logger gets a line per round. Default: discard.
	Logger *slog.Logger
}

// RunRetention purges expired rows (Purge) and marks stuck ones (MarkStuck) at once and
// then every RetentionConfig.Every whose turn this process takes, until ctx ends. It
// returns nil when ctx ends.
func (l *Ledger) RunRetention(ctx context.Context, cfg RetentionConfig) error {
	if cfg.Every <= 0 {
		cfg.Every = time.Hour
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	check := cfg.Every
	if cfg.Turn != nil {
		check = min(cfg.Every, time.Minute) // ask for the turn often; it grants one round per Every
	}
	t := time.NewTicker(check)
	defer t.Stop()
	for {
		if cfg.Turn == nil || cfg.Turn(ctx) {
			n, err := l.Purge(ctx, cfg.OlderThan, 1000)
			stuck, err2 := l.MarkStuck(ctx)
			if err = errors.Join(err, err2); err != nil && ctx.Err() == nil {
				log.Warn("retention purge", "err", err)
			} else {
				log.Info("retention purge", "purged", n, "needs_attention", stuck, "older_than", cfg.OlderThan)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
