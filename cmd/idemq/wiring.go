package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

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

// listen takes addr, which the variable name set, for a server: an address in use names
// the variable to change. Taken before anything else starts, it stops a second process
// given the same address at once.
func listen(name, addr string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%s=%s: %w: another process listens there; set %s to a free host:port", name, addr, err, name)
	}
	return ln, nil
}

// A schemaNeed is what a subcommand needs of the schema.
type schemaNeed int

const (
	// coreSchema is idemq's own tables (the ledger, the outbox, the schedule), which
	// migrations.Up creates: enough for the operator's commands.
	coreSchema schemaNeed = iota
	// exampleSchema is those and the example's tables (the handlers' and fakepay's), which
	// only `idemq migrate` (migrations.UpExample) creates: for what runs the example.
	exampleSchema
)

// requireSchema refuses to start on a database whose schema lacks what the subcommand
// (named in messages) uses, naming the fix. It only reads: a refused start leaves the
// database as it was.
func requireSchema(ctx context.Context, pool *pgxpool.Pool, cmd string, need schemaNeed) error {
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	list, err := migrations.Status(ctx, db)
	if err != nil {
		return dial.PoolerHint(fmt.Errorf("check the schema: %w", err))
	}
	var core, example []string
	for _, m := range list {
		switch {
		case m.Applied:
		case m.Set == "core":
			core = append(core, m.Path)
		default:
			example = append(example, setPrefix[1]+m.Path)
		}
	}
	if len(core) > 0 {
		return fmt.Errorf("the database schema is not current (%s): "+
			"run `idemq migrate` first (or migrations.Up from your application, which adds idemq's tables only)", pendingList("idemq's", core))
	}
	if need == exampleSchema && len(example) > 0 {
		return fmt.Errorf("idemq %s runs the example, and its tables are missing or not current (%s): "+
			"run `idemq migrate`, which adds the example's tables (wallet_entries, orders, fakepay_*) beside idemq's; "+
			"the operator's commands (ledger, schedule, migrate --status) need idemq's tables only", cmd, pendingList("the example's", example))
	}
	return nil
}

// pendingList says how many of whose migrations are pending, naming the first and last.
func pendingList(whose string, paths []string) string {
	s := fmt.Sprintf("%d of %s migrations pending: %s", len(paths), whose, paths[0])
	switch len(paths) {
	case 1:
		return s
	case 2:
		return s + ", " + paths[1]
	}
	return s + " … " + paths[len(paths)-1]
}
