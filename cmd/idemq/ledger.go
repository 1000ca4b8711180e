package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/api"
	"github.com/idemq/idemq/internal/config"
	"github.com/idemq/idemq/internal/dial"
)

func ledgerCommand() command {
	return command{
		name:    "ledger",
		usage:   "ledger show KEY | list [--status S] [--limit N] | release KEY | rerun KEY | purge --older-than D   [--json]",
		summary: "inspect and operate the ledger: show or list rows, end a lease, re-run a terminal key, purge old rows",
		spec:    func() any { return &config.Ledger{} },
		run: func(ctx context.Context, spec any, args []string, stdout, stderr io.Writer) error {
			cfg := spec.(*config.Ledger)
			if len(args) == 0 {
				return errors.New("ledger: say what: show, list, release, rerun or purge")
			}
			fs := flag.NewFlagSet("ledger "+args[0], flag.ContinueOnError)
			fs.SetOutput(stderr)
			asJSON := fs.Bool("json", false, "print JSON instead of a table")
			status := fs.String("status", "", "list: only rows in this status (in_progress, completed, failed, needs_attention)")
			limit := fs.Int("limit", 50, fmt.Sprintf("list: at most this many rows (1 to %d), newest first", maxListLimit))
			olderThan := fs.Duration("older-than", 0, "purge: remove completed and failed rows that completed longer ago than this (e.g. 720h)")
			op := args[0]
			rest, err := parseInterleaved(fs, args[1:])
			if err != nil {
				return err
			}
			wantArgs := map[string]int{"show": 1, "release": 1, "rerun": 1, "list": 0, "purge": 0}
			n, ok := wantArgs[op]
			if !ok {
				return fmt.Errorf("ledger: unknown operation %q (show, list, release, rerun, purge)", op)
			}
			if len(rest) != n {
				return fmt.Errorf("ledger %s: want %d argument(s), got %q", op, n, rest)
			}
			if n == 1 {
				if err := idempotency.ValidateKey(rest[0]); err != nil {
					return fmt.Errorf("ledger %s: key %.64q: %w", op, rest[0], err)
				}
			}
			if op == "list" && (*limit < 1 || *limit > maxListLimit) {
				return fmt.Errorf("ledger list: --limit: must be from 1 to %d, got %d", maxListLimit, *limit)
			}
			switch *status {
			case "", idempotency.StatusInProgress, idempotency.StatusCompleted, idempotency.StatusFailed, idempotency.StatusNeedsAttention:
			default:
				return fmt.Errorf("ledger list: --status: unknown status %q: want %s, %s, %s or %s", *status,
					idempotency.StatusInProgress, idempotency.StatusCompleted, idempotency.StatusFailed, idempotency.StatusNeedsAttention)
			}

			pool, err := dial.Postgres(ctx, cfg.DatabaseURL, 4)
			if err != nil {
				return err
			}
			defer pool.Close()
			if err := requireSchema(ctx, pool, "ledger", coreSchema); err != nil {
				return err
			}
			ledger := idempotency.New(pool, &idempotency.Config{HeartbeatPool: pool})
			defer ledger.Close()

			switch op {
			case "show":
				r, err := ledger.Get(ctx, rest[0])
				in, ierr := outbox.ReadIntent(ctx, pool, rest[0])
				if ierr != nil && !errors.Is(ierr, idempotency.ErrNotFound) {
					return ierr
				}
				if err != nil {
					if errors.Is(err, idempotency.ErrNotFound) && in != nil {
						return fmt.Errorf("no ledger row for key %q: its outbox intent is %s%s", rest[0], in.State, intentNote(in))
					}
					return explain(err, rest[0])
				}
				steps, err := ledger.Steps(ctx, rest[0])
				if err != nil {
					return err
				}
				history, err := ledger.History(ctx, rest[0])
				if err != nil {
					return err
				}
				return printRecord(stdout, *r, in, steps, history, *asJSON)
			case "list":
				rs, err := ledger.List(ctx, *status, *limit)
				if err != nil {
					return err
				}
				return printRecords(stdout, rs, *asJSON, false)
			case "release":
				if err := ledger.Release(ctx, rest[0]); err != nil {
					return explain(err, rest[0])
				}
				return printDone(stdout, *asJSON, map[string]any{"key": rest[0], "released": true},
					"released %s: its lease has ended; the next delivery takes it over", rest[0])
			case "rerun":
				r, err := ledger.Rerun(ctx, rest[0])
				if err != nil {
					return explain(err, rest[0])
				}
				if r.TaskID == "" {
					return printDone(stdout, *asJSON, map[string]any{"key": rest[0], "generation": r.Generation, "republished": false},
						"reopened %s as generation %d; it has no outbox intent (enqueued without the outbox, or purged), so nothing was republished: the next delivery of the key under a new TaskID runs it", rest[0], r.Generation)
				}
				return printDone(stdout, *asJSON, map[string]any{"key": rest[0], "generation": r.Generation, "republished": true, "task_id": r.TaskID},
					"reopened %s as generation %d and republished it as task %s: a worker runs it again", rest[0], r.Generation, r.TaskID)
			default: // purge
				if *olderThan <= 0 {
					return errors.New("ledger purge: --older-than is required and must be positive (e.g. --older-than 720h)")
				}
				n, err := ledger.Purge(ctx, *olderThan, 1000)
				if err != nil {
					return err
				}
				return printDone(stdout, *asJSON, map[string]any{"purged": n, "older_than": olderThan.String()},
					"purged %d completed or failed rows and dead intents without a row older than %s", n, *olderThan)
			}
		},
	}
}

// maxListLimit bounds `ledger list --limit`: each row may carry a result of up to 1 MiB.
const maxListLimit = 10_000

// parseInterleaved parses args with fs, letting flags follow the arguments as well as
// precede them ("show KEY --json"), and returns the arguments. Everything after "--" is an
// argument.
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var out []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return out, nil
		}
		if i := len(args) - len(rest) - 1; i >= 0 && args[i] == "--" {
			return append(out, rest...), nil
		}
		out, args = append(out, rest[0]), rest[1:]
	}
}

func explain(err error, key string) error {
	switch {
	case errors.Is(err, idempotency.ErrNotFound):
		return fmt.Errorf("no ledger row for key %q (never claimed, or purged)", key)
	case errors.Is(err, idempotency.ErrNotInProgress):
		return fmt.Errorf("key %q is not in progress: nothing to release", key)
	case errors.Is(err, idempotency.ErrNotTerminal):
		return fmt.Errorf("key %q is still in progress: only completed, failed or needs_attention keys (or one whose task was archived, its intent dead) can be re-run", key)
	}
	return err
}

func printDone(w io.Writer, asJSON bool, v any, format string, args ...any) error {
	if asJSON {
		return json.NewEncoder(w).Encode(v)
	}
	_, err := fmt.Fprintf(w, format+"\n", args...)
	return err
}

// printRecord prints one row, its outbox intent (nil: none) and its recorded steps.
func printRecord(w io.Writer, r idempotency.Record, in *outbox.IntentInfo, steps []idempotency.StepRecord, history []idempotency.HistoryEvent, asJSON bool) error {
	if asJSON {
		out := api.NewRecord(r)
		out.Steps = api.NewSteps(steps)
		out.History = api.NewHistory(history)
		if in != nil {
			out.Intent = in.State
			if in.State == outbox.IntentDead {
				out.IntentError = in.LastError
			}
		}
		return json.NewEncoder(w).Encode(out)
	}
	if err := printRecords(w, []idempotency.Record{r}, false, true); err != nil {
		return err
	}
	if in != nil {
		if _, err := fmt.Fprintf(w, "intent  %s%s\n", in.State, intentNote(in)); err != nil {
			return err
		}
	}
	if len(steps) > 0 {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "\nSTEP\tFENCE\tRECORDED\tRESULT")
		for _, s := range steps {
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\n", s.Name, s.Fence, stamp(s.CreatedAt), s.Result)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	return printHistory(w, history)
}

// printHistory prints a key's history as a table, oldest first; nothing when it has none.
func printHistory(w io.Writer, history []idempotency.HistoryEvent) error {
	if len(history) == 0 {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "\nHISTORY\tGEN\tKIND\tFENCE\tOLD FENCE\tTASK ID\tWORKER\tDETAIL")
	opt := func(n int64) string {
		if n == 0 {
			return "-"
		}
		return fmt.Sprint(n)
	}
	for _, e := range history {
		id := e.TaskID
		if id == "" {
			id = "-"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\n", stamp(e.At), e.Generation, e.Kind, opt(e.Fence), opt(e.OldFence), id, e.Worker, e.Detail)
	}
	return tw.Flush()
}

// intentNote says why a dead intent died: its task was refused, so the row's result (when
// it has one) is not this job's.
func intentNote(in *outbox.IntentInfo) string {
	if in.State != outbox.IntentDead || in.LastError == "" {
		return ""
	}
	return " (its task was refused: " + in.LastError + ")"
}

func printRecords(w io.Writer, rs []idempotency.Record, asJSON, one bool) error {
	if asJSON {
		out := make([]api.Record, len(rs))
		for i, r := range rs {
			out[i] = api.NewRecord(r)
		}
		return json.NewEncoder(w).Encode(out)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	if one {
		r := rs[0]
		for _, kv := range [][2]string{
			{"key", r.Key}, {"type", r.TaskType}, {"status", r.Status},
			{"fence", fmt.Sprint(r.Fence)}, {"owner", r.Owner}, {"generation", fmt.Sprint(r.Generation)},
			{"attempts", fmt.Sprint(r.Attempts)}, {"last error", r.LastError},
			{"lease until", leaseText(r)}, {"created", stamp(r.CreatedAt)},
			{"updated", stamp(r.UpdatedAt)}, {"completed", stamp(r.CompletedAt)},
			{"trace", r.TraceID}, {"result", string(r.Result)},
		} {
			fmt.Fprintf(tw, "%s\t%s\n", kv[0], kv[1])
		}
		return tw.Flush()
	}
	fmt.Fprintln(tw, "KEY\tTYPE\tSTATUS\tFENCE\tATTEMPTS\tLEASE UNTIL\tUPDATED\tRESULT")
	for _, r := range rs {
		res := string(r.Result)
		if len(res) > 60 {
			res = res[:57] + "..."
		}
		lease := "-" // only a row in progress holds a lease
		if r.Status == idempotency.StatusInProgress {
			lease = stamp(r.LockedUntil)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%s\t%s\t%s\n", r.Key, r.TaskType, r.Status, r.Fence, r.Attempts,
			lease, stamp(r.UpdatedAt), res)
	}
	if len(rs) == 0 {
		fmt.Fprintln(tw, "(no rows)")
	}
	return tw.Flush()
}

// leaseText is r's lease end, saying whether an in-progress row's lease is still live;
// "-" for a row not in progress, which holds no lease (locked_until keeps the end of the
// last one).
func leaseText(r idempotency.Record) string {
	switch {
	case r.Status != idempotency.StatusInProgress:
		return "-"
	case r.LeaseLive:
		return stamp(r.LockedUntil) + " (live)"
	}
	return stamp(r.LockedUntil) + " (lapsed: the next delivery takes it over)"
}

func stamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05.000Z")
}
