// Command idemq runs idemq's worker, API, stand-in payment provider and operator tools.
// Run `idemq help` for the subcommands and the environment variables each one reads.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/idemq/idemq/internal/config"
	"github.com/idemq/idemq/internal/dial"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil && !errors.Is(err, errHelpShown) {
		fmt.Fprintln(os.Stderr, "idemq:", err)
		os.Exit(1)
	}
}

// errHelpShown ends a run that only printed help.
var errHelpShown = errors.New("help shown")

// command is one subcommand: its configuration (read from the environment with envconfig
// inside run) and what it does.
type command struct {
	name    string
	usage   string
	summary string
	spec    func() any // a fresh config struct; nil when the command reads no environment
	traced  string     // the OpenTelemetry service name of a command that can trace, else ""
	run     func(ctx context.Context, spec any, args []string, stdout, stderr io.Writer) error
}

func commands() []command {
	return []command{
		migrateCommand(),
		workerCommand(),
		apiCommand(),
		schedulerCommand(),
		scheduleCommand(),
		demoCommand(),
		enqueueCommand(),
		ledgerCommand(),
		fakepayCommand(),
		healthcheckCommand(),
		versionCommand(),
	}
}

// run is the whole program: args are the arguments after the program name; the
// configuration comes from the process environment (envconfig reads it).
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		usage(stderr)
		return errors.New("no subcommand given")
	}
	name, rest := args[0], args[1:]
	switch name {
	case "help", "-h", "-help", "--help":
		if len(rest) > 0 {
			if c, ok := lookup(rest[0]); ok {
				return commandHelp(stdout, c)
			}
			return fmt.Errorf("unknown subcommand %q", rest[0])
		}
		usage(stdout)
		for _, c := range commands() {
			fmt.Fprintln(stdout)
			if err := commandHelp(stdout, c); err != nil {
				return err
			}
		}
		return nil
	}
	c, ok := lookup(name)
	if !ok {
		usage(stderr)
		return fmt.Errorf("unknown subcommand %q", name)
	}
	for _, a := range rest {
		if a == "-h" || a == "-help" || a == "--help" {
			return commandHelp(stdout, c)
		}
	}
	var spec any
	if c.spec != nil {
		spec = c.spec()
		if err := loadConfig(spec); err != nil {
			return err
		}
	}
	dial.SetRedisLogger(newLogger(stderr, config.LogLevel(spec)))
	return c.run(ctx, spec, rest, stdout, stderr)
}

func lookup(name string) (command, bool) {
	for _, c := range commands() {
		if c.name == name {
			return c, true
		}
	}
	return command{}, false
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "idemq — exactly-once effects for asynq background jobs")
	fmt.Fprintln(w, "\nUsage: idemq <subcommand> [arguments]   (idemq help <subcommand> for one)")
	fmt.Fprintln(w, "\nSubcommands:")
	width := 0
	for _, c := range commands() {
		width = max(width, len(c.name))
	}
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-*s  %s\n", width, c.name, c.summary)
	}
}

func commandHelp(w io.Writer, c command) error {
	fmt.Fprintf(w, "idemq %s\n  %s\n", c.usage, c.summary)
	if c.spec == nil {
		return nil
	}
	fmt.Fprintln(w, "\n  Environment (variable, default, meaning):")
	if err := usageConfig(w, c.spec()); err != nil {
		return err
	}
	if c.traced != "" {
		tracingHelp(w, c.traced)
		if c.name == "enqueue" {
			fmt.Fprintf(w, "  %-28s %s\n", "TRACEPARENT", "a caller's W3C traceparent: the command's span, and so the job's deliveries, continue its trace")
		}
	}
	return nil
}

// tracingHelp lists the OpenTelemetry variables a traced command reads (internal/tracing).
func tracingHelp(w io.Writer, service string) {
	fmt.Fprintln(w, "\n  Tracing, by OpenTelemetry's own variables (off unless an endpoint is set):")
	for _, v := range [][2]string{
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "the OTLP collector, e.g. http://otel-collector:4318 (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)"},
		{"OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf (default) or grpc"},
		{"OTEL_SERVICE_NAME", "default " + service},
		{"OTEL_TRACES_SAMPLER", "default parentbased_always_on; OTEL_TRACES_SAMPLER_ARG is its argument (0.01: 1 %)"},
		{"OTEL_SDK_DISABLED", "true: off, whatever else is set"},
	} {
		fmt.Fprintf(w, "  %-28s %s\n", v[0], v[1])
	}
}
