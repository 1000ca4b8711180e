package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/idemq/idemq/internal/config"
	"github.com/idemq/idemq/internal/dial"
	"github.com/idemq/idemq/migrations"
)

func migrateCommand() command {
	return command{
		name:    "migrate",
		usage:   "migrate [status]",
		summary: "apply the ledger's schema migrations (safe to run concurrently and repeatedly); `status` lists them",
		spec:    func() any { return &config.Migrate{} },
		run: func(ctx context.Context, spec any, args []string, stdout, _ io.Writer) error {
			cfg := spec.(*config.Migrate)
			if len(args) > 1 || (len(args) == 1 && args[0] != "status") {
				return fmt.Errorf("migrate: unexpected arguments %q (usage: idemq migrate [status])", args)
			}
			// goose serialises concurrent migrations with a session advisory lock, which a
			// transaction-mode pooler does not keep: migrate needs Postgres itself.
			dsn, name := cfg.DatabaseURL, "DATABASE_URL"
			if cfg.DirectDatabaseURL != "" {
				dsn, name = cfg.DirectDatabaseURL, "IDEMQ_DIRECT_DATABASE_URL"
			}
			pc, err := pgx.ParseConfig(dsn)
			if err != nil {
				return fmt.Errorf("%s: %w", name, config.URLError(dsn, err))
			}
			if err := dial.RequireSession(ctx, pc, name); err != nil {
				if errors.Is(err, dial.ErrTransactionPooler) {
					return fmt.Errorf("migrate: %w, where the migration lock (a session advisory lock) holds nothing: "+
						"set IDEMQ_DIRECT_DATABASE_URL to Postgres itself", err)
				}
				return err
			}
			db := stdlib.OpenDB(*pc)
			defer db.Close()
			p, err := migrations.NewProvider(ctx, db)
			if err != nil {
				return err
			}
			if len(args) == 1 {
				return printStatus(ctx, p, stdout)
			}
			res, err := p.Up(ctx)
			for _, r := range res {
				fmt.Fprintf(stdout, "applied %s (%s)\n", r.Source.Path, r.Duration.Round(1e6))
			}
			if err != nil {
				return fmt.Errorf("migrate: %w", err)
			}
			v, err := p.GetDBVersion(ctx)
			if err != nil {
				return fmt.Errorf("migrate: %w", err)
			}
			if len(res) == 0 {
				fmt.Fprintf(stdout, "schema is current (version %d); nothing to apply\n", v)
			} else {
				fmt.Fprintf(stdout, "schema is now at version %d\n", v)
			}
			return nil
		},
	}
}

func printStatus(ctx context.Context, p *goose.Provider, w io.Writer) error {
	st, err := p.Status(ctx)
	if err != nil {
		return fmt.Errorf("migrate status: %w", err)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VERSION\tMIGRATION\tSTATE\tAPPLIED AT")
	for _, m := range st {
		at := "-"
		if !m.AppliedAt.IsZero() {
			at = m.AppliedAt.Format("2006-01-02 15:04:05")
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\n", m.Source.Version, m.Source.Path, m.State, at)
	}
	return tw.Flush()
}
