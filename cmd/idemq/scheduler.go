package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/idempotency/schedule"
	"github.com/idemq/idemq/internal/api"
	"github.com/idemq/idemq/internal/config"
	"github.com/idemq/idemq/internal/dial"
	"github.com/idemq/idemq/internal/metrics"
	"github.com/idemq/idemq/internal/process"
	"github.com/idemq/idemq/tasks"
)

func schedulerCommand() command {
	return command{
		name:    "scheduler",
		usage:   "scheduler",
		summary: "run one scheduler replica: each tick of each periodic entry becomes one job (run as many as you like)",
		spec:    func() any { return &config.Scheduler{} },
		run: func(ctx context.Context, spec any, args []string, _, stderr io.Writer) error {
			if len(args) > 0 {
				return fmt.Errorf("scheduler: unexpected arguments %q", args)
			}
			cfg := spec.(*config.Scheduler)
			return runScheduler(ctx, cfg, newLogger(stderr, cfg.LogLevel).With("cmd", "scheduler"))
		},
	}
}

func runScheduler(ctx context.Context, cfg *config.Scheduler, log *slog.Logger) error {
	var entries []schedule.Entry
	if cfg.ScheduleFile != "" {
		var err error
		if entries, err = schedule.ReadFile(cfg.ScheduleFile); err != nil {
			return fmt.Errorf("IDEMQ_SCHEDULE_FILE: %w", err)
		}
		if entries == nil {
			entries = []schedule.Entry{} // an empty file empties the schedule
		}
	}
	var metricsLn net.Listener
	if cfg.MetricsAddr != "" {
		var err error
		if metricsLn, err = net.Listen("tcp", cfg.MetricsAddr); err != nil {
			return fmt.Errorf("IDEMQ_METRICS_ADDR=%s: %w: each process on one host needs an address of its own, or set it empty", cfg.MetricsAddr, err)
		}
		defer metricsLn.Close()
	}
	rdb, err := dial.Redis(ctx, cfg.RedisURL, cfg.RedisCluster)
	if err != nil {
		return err
	}
	defer rdb.Close()
	pool, err := dial.Postgres(ctx, cfg.DatabaseURL, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := requireSchema(ctx, pool, "scheduler", coreSchema); err != nil {
		return err
	}
	reg := process.Start(ctx, pool, process.RoleScheduler, log, nil)
	defer reg.Stop()
	m := metrics.New()
	client := outbox.NewClient(pool, rdb, &outbox.Config{Logger: log,
		Observe: func(ev outbox.Event, taskType string) { m.ObserveOutbox(string(ev), taskType) }})
	if cfg.UnsafeWallClock {
		log.Warn("IDEMQ_UNSAFE_SCHEDULE_WALLCLOCK is set: ticks are keyed by this replica's clock, not by their scheduled instant; replicas will enqueue a tick twice or not at all (tests only)")
	}
	s, err := schedule.New(pool, client, entries, &schedule.Config{Retention: cfg.Retention, Logger: log, TaskTypes: servedTaskTypes,
		UnsafeWallClockKeys: cfg.UnsafeWallClock,
		Observe:             func(ev schedule.Event, entry string) { m.ScheduleTicks.WithLabelValues(entry, string(ev)).Inc() }})
	if err != nil {
		return fmt.Errorf("IDEMQ_SCHEDULE_FILE: %w", err)
	}
	if entries == nil {
		log.Info("IDEMQ_SCHEDULE_FILE is unset: scheduling the entries other replicas wrote")
	}

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 2)
	go func() { done <- s.Run(runCtx) }()
	// The ticks' jobs are published by any relay (the workers', the API's); this
	// process's own publishes them even when none runs.
	go func() { done <- client.RunRelay(runCtx) }()
	httpErr := serveMetrics(runCtx, m, metricsLn, cfg.MetricsAddr, rdb, pool, log)
	log.Info("scheduler started", "entries", len(entries), "file", cfg.ScheduleFile)
	select {
	case err = <-done:
	case err = <-httpErr:
	}
	cancel()
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// servedTaskTypes are the task types this binary's workers serve, each with its handler's
// check of a payload: a scheduler refuses, at its start, an entry of another type or whose
// job the handler would refuse.
var servedTaskTypes = map[string]func([]byte) error{
	tasks.TypeCharge:   func(b []byte) error { _, err := tasks.DecodeCharge(b); return err },
	tasks.TypeDebit:    func(b []byte) error { _, err := tasks.DecodeDebit(b); return err },
	tasks.TypeCheckout: func(b []byte) error { _, err := tasks.DecodeCheckout(b); return err },
	tasks.TypeSettle:   func(b []byte) error { _, err := tasks.DecodeSettle(b); return err },
}

func scheduleCommand() command {
	return command{
		name:    "schedule",
		usage:   "schedule list [--json] | pause NAME | resume NAME | run NAME [--id ID]",
		summary: "operate the periodic schedule: list entries with their last and next tick, pause or resume one, run one now",
		spec:    func() any { return &config.Schedule{} },
		run: func(ctx context.Context, spec any, args []string, stdout, stderr io.Writer) error {
			cfg := spec.(*config.Schedule)
			if len(args) == 0 {
				return errors.New("schedule: say what: list, pause, resume or run")
			}
			fs := flag.NewFlagSet("schedule "+args[0], flag.ContinueOnError)
			fs.SetOutput(stderr)
			asJSON := fs.Bool("json", false, "list: print JSON instead of a table")
			id := fs.String("id", "", "run: the manual run's id (its job's key is cron:NAME:manual:ID); default the current time, to the second")
			op := args[0]
			rest, err := parseInterleaved(fs, args[1:])
			if err != nil {
				return err
			}
			want := map[string]int{"list": 0, "pause": 1, "resume": 1, "run": 1}
			n, ok := want[op]
			if !ok {
				return fmt.Errorf("schedule: unknown operation %q (list, pause, resume, run)", op)
			}
			if len(rest) != n {
				return fmt.Errorf("schedule %s: want %d argument(s), got %q", op, n, rest)
			}
			pool, err := dial.Postgres(ctx, cfg.DatabaseURL, 2)
			if err != nil {
				return err
			}
			defer pool.Close()
			if err := requireSchema(ctx, pool, "schedule", coreSchema); err != nil {
				return err
			}
			switch op {
			case "list":
				list, err := schedule.List(ctx, pool, time.Now())
				if err != nil {
					return err
				}
				return printSchedule(stdout, list, *asJSON)
			case "pause":
				if err := schedule.Pause(ctx, pool, rest[0]); err != nil {
					return err
				}
				fmt.Fprintf(stdout, "paused %s: its ticks are skipped until it is resumed\n", rest[0])
				return nil
			case "resume":
				if err := schedule.Resume(ctx, pool, rest[0]); err != nil {
					return err
				}
				fmt.Fprintf(stdout, "resumed %s: it ticks again from the next round (paused ticks are not caught up)\n", rest[0])
				return nil
			}
			now := time.Now().UTC()
			if *id == "" {
				*id = now.Format("20060102T150405Z")
			}
			rdb, err := dial.Redis(ctx, cfg.RedisURL, cfg.RedisCluster)
			if err != nil {
				return err
			}
			defer rdb.Close()
			res, err := schedule.RunNow(ctx, pool, outbox.NewClient(pool, rdb, nil), rest[0], *id, now)
			if err != nil {
				return err
			}
			what := "enqueued"
			if res.Duplicate {
				what = "already enqueued (the same id is the same run)"
			}
			fmt.Fprintf(stdout, "%s %s: %s\n", what, res.Key, res.State)
			return nil
		},
	}
}

// printSchedule prints entries as a table, or as JSON.
func printSchedule(w io.Writer, list []schedule.Status, asJSON bool) error {
	if asJSON {
		return json.NewEncoder(w).Encode(api.NewScheduleEntries(list))
	}
	if len(list) == 0 {
		_, err := fmt.Fprintln(w, "no entries: start `idemq scheduler` with IDEMQ_SCHEDULE_FILE")
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tSCHEDULE\tTASK TYPE\tREV\tSTATE\tLAST TICK\tLAST JOB\tNEXT TICK")
	for _, s := range list {
		state := "active"
		if s.Paused {
			state = "paused"
		}
		sched := s.Schedule
		if s.TimeZone != "" {
			sched += " (" + s.TimeZone + ")"
		}
		last, job, next := "-", "-", "-"
		if !s.LastTick.IsZero() {
			last = s.LastTick.UTC().Format(schedule.TickLayout)
			job = strings.TrimSpace(s.LastState)
			if job == "" {
				job = "(purged)"
			}
		}
		if !s.Next.IsZero() {
			next = s.Next.UTC().Format(schedule.TickLayout)
		}
		if s.Err != nil {
			sched = "unreadable: " + s.Err.Error()
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", s.Name, sched, s.TaskType, s.Revision, state, last, job, next)
	}
	return tw.Flush()
}
