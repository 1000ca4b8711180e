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
		summary: "apply idemq's schema migrations, then the example's tables (safe to run concurrently and repeatedly); `status` lists them",
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
			// The core set first, then the example's (the handlers' and fakepay's tables).
			core, err := migrations.NewProvider(ctx, db)
			if err != nil {
				return err
			}
			example, err := migrations.NewExampleProvider(ctx, db)
			if err != nil {
				return err
			}
			if len(args) == 1 {
				return printStatus(ctx, stdout, core, example)
			}
			applied := 0
			var versions [2]int64
			for i, p := range []*goose.Provider{core, example} {
				res, err := p.Up(ctx)
				for _, r := range res {
					fmt.Fprintf(stdout, "applied %s%s (%s)\n", setPrefix[i], r.Source.Path, r.Duration.Round(1e6))
				}
				if err != nil {
					return fmt.Errorf("migrate: %w", err)
				}
				applied += len(res)
				if versions[i], err = p.GetDBVersion(ctx); err != nil {
					return fmt.Errorf("migrate: %w", err)
				}
			}
			if applied == 0 {
				fmt.Fprintf(stdout, "schema is current (version %d; example tables at version %d); nothing to apply\n", versions[0], versions[1])
			} else {
				fmt.Fprintf(stdout, "schema is now at version %d; example tables at version %d\n", versions[0], versions[1])
			}
			return nil
		},
	}
}

// setPrefix names each set's files in migrate's output: the core set's bare, the
// example's under example/, where they are in the source.
var setPrefix = [2]string{"", "example/"}

func printStatus(ctx context.Context, w io.Writer, providers ...*goose.Provider) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VERSION\tMIGRATION\tSTATE\tAPPLIED AT")
	for i, p := range providers {
		st, err := p.Status(ctx)
		if err != nil {
			return fmt.Errorf("migrate status: %w", err)
		}
		for _, m := range st {
			at := "-"
			if !m.AppliedAt.IsZero() {
				at = m.AppliedAt.Format("2006-01-02 15:04:05")
			}
			fmt.Fprintf(tw, "%d\t%s%s\t%s\t%s\n", m.Source.Version, setPrefix[i], m.Source.Path, m.State, at)
		}
	}
	return tw.Flush()
}
