package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
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
		usage:   "migrate [--status | --dry-run]",
		summary: "apply idemq's schema migrations, then the example's tables (safe to run concurrently and repeatedly); refuses a contract step while an older release runs; --status lists the migrations, --dry-run says what would be applied",
		spec:    func() any { return &config.Migrate{} },
		run: func(ctx context.Context, spec any, args []string, stdout, stderr io.Writer) error {
			cfg := spec.(*config.Migrate)
			fs := flag.NewFlagSet("migrate", flag.ContinueOnError)
			fs.SetOutput(stderr)
			status := fs.Bool("status", false, "list the migrations, applied and pending, each marked expand or contract, and the live processes")
			dryRun := fs.Bool("dry-run", false, "say what would be applied, and whether a contract step would be refused; apply nothing")
			rest, err := parseInterleaved(fs, args)
			if err != nil {
				return err
			}
			if len(rest) == 1 && rest[0] == "status" { // the older spelling
				*status, rest = true, nil
			}
			if len(rest) > 0 || (*status && *dryRun) {
				return fmt.Errorf("migrate: unexpected arguments %q (usage: idemq migrate [--status | --dry-run])", args)
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
			switch {
			case *status:
				return printStatus(ctx, stdout, db)
			case *dryRun:
				return dryRunMigrate(ctx, stdout, db)
			}
			// Both sets' contract steps are checked before either set is applied.
			if err := migrations.Check(ctx, db); err != nil {
				return fmt.Errorf("migrate: %w", err)
			}
			// The core set first, then the example's (the handlers' and fakepay's tables).
			applied := 0
			var versions [2]int64
			for i, up := range []func(context.Context, *sql.DB) ([]*goose.MigrationResult, error){migrations.Up, migrations.UpExample} {
				res, err := up(ctx, db)
				for _, r := range res {
					fmt.Fprintf(stdout, "applied %s%s (%s)\n", setPrefix[i], r.Source.Path, r.Duration.Round(1e6))
				}
				if err != nil {
					return fmt.Errorf("migrate: %w", err)
				}
				applied += len(res)
			}
			for i, newProvider := range []func(context.Context, *sql.DB) (*goose.Provider, error){migrations.NewProvider, migrations.NewExampleProvider} {
				p, err := newProvider(ctx, db)
				if err != nil {
					return err
				}
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

func prefix(set string) string {
	if set == "example" {
		return setPrefix[1]
	}
	return setPrefix[0]
}

func kind(m migrations.Migration) string {
	if m.Contract {
		return fmt.Sprintf("contract (requires schema %d)", m.RequiresSchema)
	}
	return m.Kind()
}

func printStatus(ctx context.Context, w io.Writer, db *sql.DB) error {
	list, err := migrations.Status(ctx, db)
	if err != nil {
		return fmt.Errorf("migrate status: %w", err)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VERSION\tMIGRATION\tKIND\tSTATE\tAPPLIED AT")
	for _, m := range list {
		state, at := "pending", "-"
		if m.Applied {
			state = "applied"
			if !m.AppliedAt.IsZero() {
				at = m.AppliedAt.Format("2006-01-02 15:04:05")
			}
		}
		fmt.Fprintf(tw, "%d\t%s%s\t%s\t%s\t%s\n", m.Version, prefix(m.Set), m.Path, kind(m), state, at)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	live, err := migrations.LiveProcesses(ctx, db)
	if err != nil {
		return fmt.Errorf("migrate status: %w", err)
	}
	fmt.Fprintf(w, "\n%d live process(es) (heartbeat within %s; releases before idemq_processes do not register)", len(live), migrations.LiveWindow)
	if len(live) == 0 {
		_, err := fmt.Fprintln(w)
		return err
	}
	fmt.Fprintln(w, ":")
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ROLE\tHOST\tPID\tVERSION\tSCHEMA\tSTARTED AT")
	for _, p := range live {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%d\t%s\n", p.Role, p.Host, p.PID, p.Version, p.Schema, p.StartedAt.UTC().Format("2006-01-02 15:04:05"))
	}
	return tw.Flush()
}

// dryRunMigrate says what migrate would apply and whether it would refuse a contract step.
// Like --status, it only reads: the schema is left exactly as it was.
func dryRunMigrate(ctx context.Context, w io.Writer, db *sql.DB) error {
	list, err := migrations.Status(ctx, db)
	if err != nil {
		return fmt.Errorf("migrate --dry-run: %w", err)
	}
	n := 0
	for _, m := range list {
		if !m.Applied {
			fmt.Fprintf(w, "would apply %s%s (%s)\n", prefix(m.Set), m.Path, kind(m))
			n++
		}
	}
	if err := migrations.Check(ctx, db); err != nil {
		return fmt.Errorf("migrate --dry-run: migrate would refuse: %w", err)
	}
	if n == 0 {
		fmt.Fprintln(w, "schema is current; nothing to apply (dry run)")
	} else {
		fmt.Fprintf(w, "%d migration(s) to apply; nothing applied (dry run)\n", n)
	}
	return nil
}
