package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency/schedule"
	"github.com/idemq/idemq/internal/localserver"
	"github.com/idemq/idemq/tasks"
)

// The demo runs the example's schedule (tasks/schedule.yaml) in two `idemq scheduler`
// replicas, with one entry of its own that ticks every 2 s, so that a run of a minute or
// two sees some thirty ticks: the example's minutely entry alone would tick once or twice.
// Once demoKillAfter of its ticks are enqueued, scheduler 1 is SIGKILLed; once
// demoMinTicks are, the schedulers stop. Every tick between the first and the last must be
// one settlement.
const (
	demoTickEntry  = "settle-demo"
	demoTickEvery  = 2 * time.Second
	demoSchedulers = 2
	demoKillAfter  = 3
	demoMinTicks   = 6
)

// demoTicks is what the demo measured of its ticks.
type demoTicks struct {
	expected, enqueued, settled, most, settlements int
	schedKilled                                    bool
}

// demoScheduleFile writes the demo's schedule file into dir: the example's entries and
// demoTickEntry.
func demoScheduleFile(dir string) (string, error) {
	example, err := schedule.ParseFile(tasks.ExampleSchedule)
	if err != nil {
		return "", fmt.Errorf("demo: the example schedule: %w", err)
	}
	text := string(tasks.ExampleSchedule) + fmt.Sprintf(`  # The demo's own entry: a settlement of every %[2]s.
  - name: %[1]s
    schedule: "@every %[2]s"
    task_type: %[3]s
    payload: {period: %[2]s}
    max_retry: 5
`, demoTickEntry, demoTickEvery, tasks.TypeSettle)
	entries, err := schedule.ParseFile([]byte(text))
	if err != nil || len(entries) != len(example)+1 {
		return "", fmt.Errorf("demo: the example schedule with %s added: %d entries, %v", demoTickEntry, len(entries), err)
	}
	path := filepath.Join(dir, "schedule.yaml")
	return path, os.WriteFile(path, []byte(text), 0o644)
}

// startSchedulers starts the demo's scheduler replicas on file.
func (st *demoStack) startSchedulers(file string) error {
	for i := range demoSchedulers {
		port, err := localserver.FreePort()
		if err != nil {
			return err
		}
		env := append(slices.Clip(st.env), "IDEMQ_SCHEDULE_FILE="+file, fmt.Sprintf("IDEMQ_METRICS_ADDR=127.0.0.1:%d", port))
		if err := st.start(fmt.Sprintf("scheduler%d", i+1), env, fmt.Sprintf("http://127.0.0.1:%d/readyz", port)); err != nil {
			return err
		}
		st.schedulers = append(st.schedulers, st.procs[len(st.procs)-1])
	}
	return nil
}

// tickKeys are the keys of the demo entry's ticks that were enqueued.
const tickKeys = `SELECT idempotency_key FROM job_intents WHERE idempotency_key LIKE 'cron:` + demoTickEntry + `:%'`

// drainTicks lets the schedulers run until demoMinTicks ticks are enqueued, SIGKILLing
// scheduler 1 on the way; then stops them, waits (up to a minute) until every tick they
// enqueued is settled, re-delivering under a new TaskID those a killed worker held (asynq
// would only after 60–120 s), and measures the ticks.
func (st *demoStack) drainTicks(ctx context.Context, guarded bool, ticks *demoTicks, out io.Writer) error {
	for wait := time.Now().Add(demoMinTicks*demoTickEvery + 10*time.Second); time.Now().Before(wait) && ctx.Err() == nil; {
		var n int
		if err := st.pool.QueryRow(ctx, `SELECT count(*) FROM (`+tickKeys+`) x`).Scan(&n); err != nil {
			return err
		}
		if n >= demoKillAfter && !ticks.schedKilled && len(st.schedulers) > 0 {
			ticks.schedKilled = true
			st.schedulers[0].Process.Signal(syscall.SIGKILL)
			fmt.Fprintf(out, "  SIGKILLed scheduler 1 (pid %d) with %d ticks of %s enqueued\n", st.schedulers[0].Process.Pid, n, demoTickEntry)
		}
		if n >= demoMinTicks {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	stopProcs(st.schedulers)
	// Unsettled ticks: with guards, not completed in the ledger (a nudge to one whose
	// lease is live is answered busy and retried); without, no settlement row yet.
	unsettled := tickKeys + ` AND NOT EXISTS (SELECT 1 FROM processed_jobs p
		WHERE p.idempotency_key = job_intents.idempotency_key AND p.status = 'completed')`
	if !guarded {
		unsettled = tickKeys + ` AND NOT EXISTS (SELECT 1 FROM wallet_settlements s
			WHERE s.settlement_key = job_intents.idempotency_key)`
	}
	client := asynq.NewClientFromRedisClient(st.rdb)
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		// The unsettled ticks, each with whether it is old enough to redeliver.
		rows, err := st.pool.Query(ctx, `SELECT idempotency_key, task_type, payload, queue, max_retry,
			created_at < now() - interval '2 seconds' FROM job_intents WHERE idempotency_key IN (`+unsettled+`)`)
		if err != nil {
			return err
		}
		type intent struct {
			key, taskType string
			payload       []byte
			queue         string
			maxRetry      int
			due           bool
		}
		left, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (intent, error) {
			var in intent
			return in, r.Scan(&in.key, &in.taskType, &in.payload, &in.queue, &in.maxRetry, &in.due)
		})
		if err != nil {
			return err
		}
		if len(left) == 0 {
			break
		}
		for _, in := range left {
			if in.due {
				client.EnqueueContext(ctx, asynq.NewTask(in.taskType, in.payload,
					asynq.TaskID(in.key+"#nudge-"+randomHex(3)), asynq.Queue(in.queue), asynq.MaxRetry(in.maxRetry)))
			}
		}
		time.Sleep(time.Second)
	}
	return st.measureTicks(ctx, ticks)
}

// measureTicks counts the demo entry's ticks: expected are the ticks from the first
// enqueued to the last (2 s apart); a tick missing in between was lost.
func (st *demoStack) measureTicks(ctx context.Context, ticks *demoTicks) error {
	rows, err := st.pool.Query(ctx, tickKeys)
	if err != nil {
		return err
	}
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	ticks.enqueued = len(keys)
	var first, last time.Time
	for _, k := range keys {
		at, err := time.Parse(schedule.TickLayout, strings.TrimPrefix(k, "cron:"+demoTickEntry+":"))
		if err != nil {
			return fmt.Errorf("demo: tick key %q: %w", k, err)
		}
		if first.IsZero() || at.Before(first) {
			first = at
		}
		if at.After(last) {
			last = at
		}
	}
	if len(keys) > 0 {
		ticks.expected = int(last.Sub(first)/demoTickEvery) + 1
	}
	return st.pool.QueryRow(ctx, `SELECT count(DISTINCT settlement_key), coalesce(max(n), 0), coalesce(sum(n), 0)
		FROM (SELECT settlement_key, count(*) n FROM wallet_settlements
		      WHERE settlement_key LIKE 'cron:`+demoTickEntry+`:%' GROUP BY settlement_key) x`).
		Scan(&ticks.settled, &ticks.most, &ticks.settlements)
}

// ok says whether every tick from the first to the last was enqueued and settled once.
func (t demoTicks) ok() bool {
	return t.expected > 0 && t.enqueued == t.expected && t.settled == t.expected && t.settlements == t.expected
}
