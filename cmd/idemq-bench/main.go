// Command idemq-bench measures what idemq costs on top of bare asynq: its layers side by
// side in one process, interleaved, and the binaries users run (`idemq worker`, `idemq
// api`, in processes of their own) against bare asynq on the same tasks. It is a tool of
// this repository, not part of the idemq binary. Run `idemq-bench -h` for the environment
// it reads and its flags; docs/performance.md has the figures and how to reproduce them.
package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/idemq/idemq/internal/bench"
	"github.com/idemq/idemq/internal/config"
	"github.com/idemq/idemq/internal/dial"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "idemq-bench:", err)
		os.Exit(1)
	}
}

// benchConfig is what idemq-bench reads from the environment.
type benchConfig struct {
	config.Redis
	config.Database
	config.Log
}

const (
	usageLine = "idemq-bench [-reps 3] [-seconds 2] [-concurrency 50] [-workloads noop,debit,charge[,scale,io]] [-n N] [-json PATH] [-svg PATH] [-write-docs] | idemq-bench -memory [-memory-tasks 100000] [-memory-configs A,E,F] [-memprofile DIR] | idemq-bench -drain [-idemq PATH] | idemq-bench -workloads api [-idemq PATH] | idemq-bench -soak [-soak-minutes 35] [-soak-rate-frac 0.7] [-soak-retention 5m] [-soak-workload debit-distinct] [-json PATH] [-idemq PATH]"
	summary   = "measure bare asynq against + lock, + ledger (leased, transactional) and the full stack, interleaved, with ratios " +
		"(defaults take ~2 min; a full run, ~20–30 min: -seconds 15 -workloads noop,debit,charge,scale,io); " +
		"-memory instead runs each configuration's server in a process of its own and reports its RSS over 100,000 tasks; " +
		"-drain and -workloads api run the idemq binary's worker and api (-idemq, built from cmd/idemq by default); " +
		"-soak runs its worker for -soak-minutes at a steady share of its maximum with a short retention and judges the drift against targets"
)

// run is the whole program: args are the arguments after the program name; the
// configuration comes from the process environment (envconfig reads it).
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	for _, a := range args {
		if a == "-h" || a == "-help" || a == "--help" {
			return help(ctx, stdout, stderr)
		}
	}
	var c benchConfig
	if err := config.Load(&c); err != nil {
		return err
	}
	var level slog.Level
	level.UnmarshalText([]byte(c.LogLevel)) // checked by config.Load
	dial.SetRedisLogger(slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level})))
	return bench.Main(ctx, c.RedisURL, c.DatabaseURL, args, stdout, stderr)
}

// help prints the usage, the environment idemq-bench reads and its flags.
func help(ctx context.Context, stdout, stderr io.Writer) error {
	fmt.Fprintf(stdout, "%s\n  %s\n", usageLine, summary)
	fmt.Fprintln(stdout, "\n  Environment (variable, default, meaning):")
	if err := config.Usage(stdout, &benchConfig{}); err != nil {
		return err
	}
	fmt.Fprintln(stdout)
	return bench.Main(ctx, "", "", []string{"-flags"}, stdout, stderr)
}
