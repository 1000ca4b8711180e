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
	// Every is how often a round may run. Default 1m: rounds that follow the inflow of
	// expiring rows delete a minute of them at a time instead of an hour's in one burst.
	Every time.Duration
	// Budget is how long a round may purge: it stops after the batch that ends past it and
	// leaves the rest to the next rounds (reported to Config.ObservePurgeBacklog), so that
	// a large backlog is worked off over several rounds. Keep it under Every, so that rounds of different replicas do not
	// overlap (they would be safe, only wasteful). Default Every/2.
	Budget time.Duration
	// Batch is how many rows each purge statement deletes, in its own transaction (see
	// Purge). Default 1000.
	Batch int
	// Turn, if set, is asked every Every/4 (at most every minute) whether this process
	// takes a round now; it should grant one round per Every across all replicas (for
	// example a Redis lock with a TTL of Every, taken and left to expire). Asking more
	// often than Every keeps the rounds at most a quarter late, whichever replica's clock
	// meets the lock's expiry first. Default: no coordination, a round every Every.
	Turn func(ctx context.Context) bool
	// Logger gets a line per round that purged or marked rows (the others log at debug
	// level). Default: discard.
	Logger *slog.Logger
}

// RunRetention runs a retention round at once and then every RetentionConfig.Every whose
// turn this process takes, until ctx ends. A round purges expired rows (Purge) for at
// most RetentionConfig.Budget, reports what it left to purge (Config.ObservePurgeBacklog)
// and marks stuck rows (MarkStuck). It returns nil when ctx ends.
func (l *Ledger) RunRetention(ctx context.Context, cfg RetentionConfig) error {
	if cfg.Every <= 0 {
		cfg.Every = time.Minute
	}
	if cfg.Budget <= 0 {
		cfg.Budget = cfg.Every / 2
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	check := cfg.Every
	if cfg.Turn != nil {
		check = max(min(cfg.Every/4, time.Minute), 1) // ask for the turn often; it grants one round per Every
	}
	t := time.NewTicker(check)
	defer t.Stop()
	for {
		if cfg.Turn == nil || cfg.Turn(ctx) {
			l.retentionRound(ctx, cfg)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// retentionRound purges for at most cfg.Budget, counts what it left behind, marks stuck
// rows, and reports (Config.ObservePurgeBacklog) and logs what it did. The stuck-row
// sweep runs every round: it reads only the open rows (processed_jobs_open_idx), so a row
// past the maximum age is set aside within a round.
func (l *Ledger) retentionRound(ctx context.Context, cfg RetentionConfig) {
	began := time.Now()
	n, caughtUp, err := l.purge(ctx, cfg.OlderThan, cfg.Batch, began.Add(cfg.Budget))
	// A purge that failed leaves a backlog too: counted, so that a purge failing round
	// after round shows as one falling behind.
	var backlog int64
	var errBacklog error
	if !caughtUp && ctx.Err() == nil {
		backlog, errBacklog = l.purgeBacklog(ctx, cfg.OlderThan)
	}
	stuck, errStuck := l.MarkStuck(ctx)
	if l.cfg.ObservePurgeBacklog != nil && errBacklog == nil && ctx.Err() == nil {
		l.cfg.ObservePurgeBacklog(backlog, 3*cfg.Every)
	}
	log := cfg.Logger
	attrs := []any{"purged", n, "backlog", backlog, "needs_attention", stuck, "older_than", cfg.OlderThan,
		"took", time.Since(began).Round(time.Millisecond)}
	switch err = errors.Join(err, errBacklog, errStuck); {
	case err != nil && ctx.Err() == nil:
		log.Warn("retention round", append(attrs, "err", err)...)
	case n > 0 || stuck > 0 || backlog > 0:
		log.Info("retention round", attrs...)
	default:
		log.Debug("retention round", attrs...)
	}
}
