package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/idemq/idemq/internal/dial"
	"github.com/idemq/idemq/internal/tracing"
	"github.com/idemq/idemq/migrations"
)

const defaultShutdown = 10 * time.Second

func newLogger(w io.Writer, level string) *slog.Logger {
	var l slog.Level
	l.UnmarshalText([]byte(level)) // checked by config.Load
	return slog.New(tracing.LogHandler(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l})))
}

// startTracing turns tracing on when the environment asks for it (internal/tracing) and
// returns what flushes and stops it, within 5 s.
func startTracing(ctx context.Context, service string, log *slog.Logger) (func(), error) {
	shutdown, err := tracing.Setup(ctx, service)
	if err != nil {
		return nil, err
	}
	if tracing.Enabled() {
		log.Info("tracing to OTLP", "service", service)
	}
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := shutdown(ctx); err != nil {
			log.Warn("tracing: flush the last spans", "err", err)
		}
	}, nil
}

// requireSchema refuses to start on a database that `idemq migrate` has not brought up to
// date (the core set and the example's, whose tables the binary's handlers and fakepay
// use), naming the fix.
func requireSchema(ctx context.Context, pool *pgxpool.Pool) error {
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	for _, newProvider := range []func(context.Context, *sql.DB) (*goose.Provider, error){
		migrations.NewProvider, migrations.NewExampleProvider,
	} {
		p, err := newProvider(ctx, db)
		if err != nil {
			return dial.PoolerHint(err)
		}
		pending, err := p.HasPending(ctx)
		if err != nil {
			return dial.PoolerHint(fmt.Errorf("check schema version: %w", err))
		}
		if pending {
			return fmt.Errorf("the database schema is not current: run `idemq migrate` first")
		}
	}
	return nil
}
