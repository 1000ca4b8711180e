package idempotencytest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/idempotency/server"
)

// Config is what the harness needs from the test.
type Config struct {
	// Pool reaches the Postgres database the handlers use, migrated with idemq's
	// migrations and the application's own. The harness opens pools of its own with its
	// configuration (one per simulated worker process) and uses Pool itself only to
	// terminate the sessions of a crashed process.
	Pool *pgxpool.Pool
	// Redis reaches the Redis the handlers' worker would use. The harness opens clients of
	// its own with its options; it writes only to its own queue and lock keys, and never
	// flushes a database.
	Redis *redis.Client
	// Handlers registers the application's handlers as its server does: the function an
	// application passes its *server.Server, here given the worker the harness made for
	// one simulated process (server.Mux). Handlers or Register is required.
	Handlers func(r server.Registrar)
	// Register registers the application's handlers on mux, built with w (the worker the
	// harness made for one simulated process), for an application that wires
	// asynqmw.Transactional and asynqmw.Leased itself.
	Register func(w *asynqmw.Worker, mux *asynq.ServeMux)
	// SQL opens the *sql.DB one simulated process's database/sql handlers
	// (server.HandleSQLTx, StepSQLTx) take their transactions from
	// (idempotency.Config.SQL), for a driver other than pgx's stdlib, such as lib/pq. Its
	// sessions must carry application_name appName, so that a crash ends them. The
	// harness closes it with the process. Default: pgx's stdlib over the process's pool.
	SQL func(appName string) (*sql.DB, error)
	// Lease is the ledger lease, the lock TTL and the idle timeout of a DoTx transaction
	// in the simulated processes. Default 1s.
	Lease time.Duration
	// Timeout bounds one schedule. Default 30s.
	Timeout time.Duration
	// Logger receives the workers' logs. Default: discard.
	Logger *slog.Logger
}

// Case is a job of the application and how to count its effect.
type Case struct {
	// Name names the case's subtests.
	Name string
	// Task builds the job's task with the application's own constructor; id is unique to
	// the schedule: build the job's key (order id, reference…) from it.
	Task func(id string) (*asynq.Task, error)
	// Effects counts the effects of the job built from id, the way the application can
	// see them (rows with the reference, charges for the order at a fake provider). The
	// harness wants exactly 1 after each schedule.
	Effects func(ctx context.Context, id string) (int, error)
	// Schedules to run; nil runs every one (Schedules()).
	Schedules []Schedule
}

// Schedule names one way of delivering a case.
type Schedule string

// The schedules.
const (
	// ConcurrentDuplicates delivers the job under four TaskIDs at once, on two worker
	// processes.
	ConcurrentDuplicates Schedule = "concurrent-duplicates"
	// SequentialDuplicate delivers it again after it completed: the answer is the stored
	// result.
	SequentialDuplicate Schedule = "sequential-duplicate"
	// CrashBeforeEffect kills the worker process just after the claim, before the
	// handler's effect; another process delivers the job again.
	CrashBeforeEffect Schedule = "crash-before-effect"
	// CrashAfterEffect kills the worker process just after the handler's effect, before
	// the completion; another process delivers the job again.
	CrashAfterEffect Schedule = "crash-after-effect"
	// StaleOwner freezes the worker process inside the handler (before its effect) past
	// its lease, as a long GC pause or SIGSTOP does; another process takes the job over
	// and completes it; then the first resumes.
	StaleOwner Schedule = "stale-owner"
	// ErrorAfterEffect makes the handler's first run return a retryable error after its
	// effect happened.
	ErrorAfterEffect Schedule = "error-after-effect"
	// RedisLoss kills the worker process after the effect and then deletes asynq's copy
	// of the task and the scope's lock (the harness's own keys only), as a Redis restart
	// without persistence does; the job is published again, as the outbox reconciler does.
	RedisLoss Schedule = "redis-loss"
	// SharedBatch delivers the job three times among other deliveries of the same
	// process, so that they meet in shared commits, one of which fails once.
	SharedBatch Schedule = "shared-batch"
)

// Schedules returns every schedule, in the order Run starts them, but for
// SequentialDuplicate, which Run runs first, on its own. It holds no step schedule
// (StepSchedules).
func Schedules() []Schedule {
	return []Schedule{ConcurrentDuplicates, SequentialDuplicate, CrashBeforeEffect, CrashAfterEffect,
		StaleOwner, ErrorAfterEffect, RedisLoss, SharedBatch}
}

// Run runs every case under each of its schedules, as parallel subtests named
// case/schedule. A schedule that breaks exactly-once fails its subtest with the
// counter's value and the deliveries in order.
//
// When Case.Schedules is nil, Run also runs the step schedules of a handler that records
// steps (idempotency.Step and StepTx), three per step (StepSchedules), as parallel
// subtests case/crash-after-step:name and so on. It finds the steps from
// SequentialDuplicate, which it runs first, before the case's other schedules, for that:
// a handler that calls no step gets no other schedule.
func Run(t *testing.T, cfg Config, cases ...Case) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			schedules := c.schedules()
			if c.Schedules == nil {
				schedules = runFindingSteps(t, cfg, c)
			}
			for _, s := range schedules {
				t.Run(string(s), func(t *testing.T) {
					t.Parallel()
					Check(t, cfg, c, s)
				})
			}
		})
	}
}

// Check runs c under schedule s and reports, with tb.Errorf, whatever breaks
// exactly-once. A harness that cannot set up (the database unreachable) fails with
// tb.Fatalf.
func Check(tb testing.TB, cfg Config, c Case, s Schedule) {
	tb.Helper()
	check(tb, cfg, c, s)
}

// check is Check; it returns the report, nil when the schedule could not run.
func check(tb testing.TB, cfg Config, c Case, s Schedule) *Report {
	tb.Helper()
	rep, err := Verify(context.Background(), cfg, c, s)
	if err != nil {
		tb.Fatalf("idempotencytest %s/%s: %v", c.Name, s, err)
	}
	tb.Logf("%s/%s: %d effect(s) in %s; largest shared commit %d; deliveries in order:\n%s", c.Name, s, rep.Effects, rep.Took.Round(time.Millisecond), rep.MaxBatch, rep.Deliveries())
	for _, p := range rep.Problems {
		tb.Errorf("%s/%s: %s", c.Name, s, p)
	}
	if len(rep.Problems) > 0 {
		tb.Errorf("%s/%s: effects counted: %d; deliveries in order:\n%s", c.Name, s, rep.Effects, rep.Deliveries())
	}
	return rep
}

// Report is what one schedule saw.
type Report struct {
	Schedule Schedule
	// Effects is the case's counter after the schedule.
	Effects int
	// Problems says what broke exactly-once; empty when nothing did.
	Problems []string
	// Log is every delivery, in the order they began.
	Log []Delivery
	// MaxBatch is the largest shared commit the schedule's processes made.
	MaxBatch int
	// Took is how long the schedule ran.
	Took time.Duration
	// Steps are the steps (idempotency.Step and StepTx) the handler called, in order, on
	// the schedule's first delivery that ran it to success; none for a handler without
	// steps, or when no delivery did.
	Steps []string

	stepsKnown bool // a delivery ran the handler to success
}

// Failed reports whether the schedule broke exactly-once.
func (r *Report) Failed() bool { return len(r.Problems) > 0 }

// Delivery is one delivery of the case's job, as the harness saw it.
type Delivery struct {
	Process string // the simulated worker process: w1, w2, …
	TaskID  string
	Attempt int   // asynq's retry count
	Fence   int64 // the claim the handler ran under (0: the handler did not run)
	// Outcome is "ok", "cached (fence N)", "error: …", "crashed before the effect",
	// "crashed after the effect", "frozen", "running" (still running when the schedule
	// ended); under a step schedule also "crashed after step "name"'s effect, before its
	// record" and "frozen after step "name" past its lease, then resumed".
	Outcome string
	Result  string // the answered result, for deliveries that succeeded
}

// Deliveries formats the log, one delivery per line.
func (r *Report) Deliveries() string {
	var s string
	for i, d := range r.Log {
		fence := "handler did not run"
		if d.Fence != 0 {
			fence = fmt.Sprintf("fence %d", d.Fence)
		}
		s += fmt.Sprintf("  %d. %s task %s attempt %d: %s: %s", i+1, d.Process, d.TaskID, d.Attempt, fence, d.Outcome)
		if d.Result != "" {
			s += " → " + d.Result
		}
		s += "\n"
	}
	return s
}

func (c Case) schedules() []Schedule {
	if len(c.Schedules) > 0 {
		return c.Schedules
	}
	return Schedules()
}

// newID returns an id unique to this process's schedules: printable ASCII, no '#'.
func newID() string {
	var b [6]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// keys holds the keys of the running schedules: a key two of them use is refused.
var keys struct {
	sync.Mutex
	owner map[string]string
}

// claimKey records that the schedule run uses key; it reports the run that already does.
func claimKey(key, run string) (other string, ok bool) {
	keys.Lock()
	defer keys.Unlock()
	if keys.owner == nil {
		keys.owner = map[string]string{}
	}
	if o, found := keys.owner[key]; found && o != run {
		return o, false
	}
	keys.owner[key] = run
	return "", true
}

func releaseKeys(run string) {
	keys.Lock()
	defer keys.Unlock()
	for k, o := range keys.owner {
		if o == run {
			delete(keys.owner, k)
		}
	}
}

func (cfg Config) withDefaults() Config {
	if cfg.Lease <= 0 {
		cfg.Lease = time.Second
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 30 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return cfg
}
