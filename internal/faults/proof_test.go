//go:build faults

package faults

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/internal/localserver"
)

// profile sizes a run.
type profile struct {
	name        string
	jobs        int           // jobs per Redis mode
	spread      time.Duration // the workload sends them over this long
	nemesis     time.Duration // faults for this long
	drain       time.Duration // bound on the wait for every key and task to settle after the heal
	controlJobs int           // jobs of each negative control
}

var profiles = map[string]profile{
	"smoke": {name: "smoke", jobs: 120, spread: 40 * time.Second, nemesis: 45 * time.Second, drain: 150 * time.Second, controlJobs: 40},
	"short": {name: "short", jobs: 400, spread: 75 * time.Second, nemesis: 80 * time.Second, drain: 240 * time.Second, controlJobs: 80},
	"long":  {name: "long", jobs: 2400, spread: 9*time.Minute + 30*time.Second, nemesis: 10 * time.Minute, drain: 240 * time.Second, controlJobs: 200},
}

// faultPoints is the handler fault-point switch the workers of the main runs get.
const faultPoints = "after_claim:0.01,after_effect:0.01,debit_delay:1500ms"

// quickFaultPoints are worker 0's: its debits are quick, so they share transactions, and
// each first delivery fails after its insert, which rolls its shared transaction back.
const quickFaultPoints = "after_claim:0.01,after_effect:0.01,debit_error:1"

type report struct {
	Seed        uint64          `json:"seed"`
	Profile     string          `json:"profile"`
	Started     string          `json:"started"`
	WallSeconds float64         `json:"wall_s"`
	Runs        []runReport     `json:"runs"`
	Controls    []controlReport `json:"negative_controls"`
	Pass        bool            `json:"pass"`
	Failures    []string        `json:"failures,omitempty"` // of the suite as a whole
}

type runReport struct {
	Mode       string             `json:"redis_mode"` // the run's name: see Postgres
	DurationS  float64            `json:"duration_s"`
	NemesisS   float64            `json:"nemesis_s"`
	DrainS     float64            `json:"drain_s"`
	Verdict    verdict            `json:"verdict"`
	Counters   map[string]float64 `json:"worker_counters"`
	Nemesis    map[string]int     `json:"nemesis_events"`
	Events     []event            `json:"history"`
	Dups       int                `json:"workload_duplicates_sent"`
	DupErrors  int                `json:"workload_duplicates_unsent"`
	StopDups   int                `json:"stop_duplicates_sent"`
	Nudges     int                `json:"drain_nudges"`
	RetryRuns  int                `json:"drain_retry_tasks_run"`
	HeldKilled int                `json:"held_keys_tracked"`
	// Left10s and Left30s classify the keys not yet completed 10 s and 30 s after the
	// heal (see unsettled); LostS is how long after the heal the last key whose task
	// Redis had lost was back in Redis (0 when none was missing).
	Left10s map[string]int `json:"left_10s_after_heal"`
	Left30s map[string]int `json:"left_30s_after_heal"`
	LostS   float64        `json:"lost_tasks_back_s"`
	// RebootLost and RebootBackS are, over the reboots, the most tasks Redis lost at
	// once and the longest wait (after Redis answered again) until all were back.
	RebootLost  int     `json:"reboot_lost_tasks"`
	RebootBackS float64 `json:"reboot_lost_back_s"`
	// ResultOnly are asynq hashes holding no task message, only fields such as "result"
	// (id → fields): not a task, never run, but left in Redis for ever (docs/proof.md).
	ResultOnly map[string]string `json:"asynq_hashes_without_message,omitempty"`
	// Postgres is the run's Postgres deployment: pgSingle, with Mode naming the Redis
	// deployment ("none", "aof-always", "sentinel"), or pgSyncStandby, with Mode
	// "pg-standby" and Redis as in "none".
	Postgres string `json:"postgres"`
	// Promotions are the Postgres failovers (pgSyncStandby only): seconds from the
	// primary's SIGKILL to the standby promoted, and to the first write committed through
	// the multi-host URL (-1: not within 30 s).
	Promotions []promotionReport `json:"postgres_promotions,omitempty"`
	// Ticks is checkTicks' verdict on the periodic jobs of the run's two schedulers;
	// SchedCounters their idemq_schedule_ticks_total, summed, as "schedule:<event>".
	Ticks         tickVerdict        `json:"ticks"`
	SchedCounters map[string]float64 `json:"scheduler_counters"`
	Pass          bool               `json:"pass"`
	Failures      []string           `json:"failures,omitempty"`
}

type promotionReport struct {
	PromotedS float64 `json:"promoted_s"`
	WritableS float64 `json:"writable_s"`
}

// The Postgres deployments of runReport.Postgres.
const (
	pgSingle      = "single"               // one server
	pgSyncStandby = "primary+sync-standby" // a primary and a synchronous standby, a multi-host URL
)

type controlReport struct {
	Name     string             `json:"name"`
	Skipped  string             `json:"skipped,omitempty"`
	Verdict  verdict            `json:"verdict"`
	Counters map[string]float64 `json:"worker_counters,omitempty"`
	Ticks    *tickVerdict       `json:"ticks,omitempty"` // control (c) only
	Pass     bool               `json:"pass"`
	Failures []string           `json:"failures,omitempty"`
}

// TestProof is the whole proof: the workload under the nemesis with Redis in both
// persistence modes (in parallel), then the negative controls with the same seed.
func TestProof(t *testing.T) {
	p, ok := profiles[envOr("IDEMQ_FAULTS_PROFILE", "short")]
	if !ok {
		t.Fatalf("IDEMQ_FAULTS_PROFILE: want short or long")
	}
	seed := uint64(time.Now().UnixNano() % 1_000_000_000)
	if s := os.Getenv("IDEMQ_FAULTS_SEED"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("IDEMQ_FAULTS_SEED: %v", err)
		}
		seed = n
	}
	t.Logf("fault suite: profile %s, seed %d (replay with IDEMQ_FAULTS_SEED=%d)", p.name, seed, seed)
	start := time.Now()
	rep := &report{Seed: seed, Profile: p.name, Started: start.UTC().Format(time.RFC3339)}
	var mu sync.Mutex

	// "controls", "nemesis" or "mixed" (the mixed-version run): a part alone, while working
	// on the suite
	only := os.Getenv("IDEMQ_FAULTS_ONLY")
	t.Run("nemesis", func(t *testing.T) {
		if only == "controls" {
			t.Skip("IDEMQ_FAULTS_ONLY=controls")
		}
		for _, m := range modes(p) {
			if only == "mixed" {
				break
			}
			t.Run(m.label(), func(t *testing.T) {
				t.Parallel()
				r := runMain(t, p, seed, m)
				mu.Lock()
				rep.Runs = append(rep.Runs, r)
				mu.Unlock()
			})
		}
	})
	// The mixed-version run comes after the others, not beside them: a fifth cluster on a
	// two-core machine slows the drains past the bounds the checker holds them to.
	if mixedRun(p) && only != "controls" || only == "mixed" {
		t.Run("mixed", func(t *testing.T) {
			rep.Runs = append(rep.Runs, runMixed(t, p, seed))
		})
	}
	t.Run("controls", func(t *testing.T) {
		if only == "nemesis" || only == "mixed" {
			t.Skip("IDEMQ_FAULTS_ONLY=" + only)
		}
		t.Run("no_guards", func(t *testing.T) {
			t.Parallel()
			r := runNoGuards(t, p, seed)
			mu.Lock()
			rep.Controls = append(rep.Controls, r)
			mu.Unlock()
		})
		t.Run("no_fencing", func(t *testing.T) {
			t.Parallel()
			r := runNoFencing(t, p, seed)
			mu.Lock()
			rep.Controls = append(rep.Controls, r)
			mu.Unlock()
		})
		t.Run("wallclock_ticks", func(t *testing.T) {
			t.Parallel()
			r := runWallClockTicks(t)
			mu.Lock()
			rep.Controls = append(rep.Controls, r)
			mu.Unlock()
		})
	})
	sort.Slice(rep.Runs, func(i, j int) bool { return rep.Runs[i].Mode > rep.Runs[j].Mode })
	sort.Slice(rep.Controls, func(i, j int) bool { return rep.Controls[i].Name < rep.Controls[j].Name })
	rep.WallSeconds = time.Since(start).Seconds()
	runs := len(modes(p))
	switch {
	case only == "mixed":
		runs = 1
	case mixedRun(p):
		runs++
	}
	rep.Pass = !t.Failed() && (len(rep.Runs) == runs || only == "controls")
	reruns := 0.0
	for _, r := range rep.Runs {
		rep.Pass = rep.Pass && r.Pass
		reruns += r.Counters["ledger:shared_rerun"]
	}
	// The rollback of a shared transaction is a path of its own too; worker 0's failing
	// debits take it whenever its deliveries meet, which a run may happen not to see.
	if len(rep.Runs) > 0 && reruns == 0 && only != "mixed" {
		rep.Pass = false
		rep.Failures = append(rep.Failures, "no shared transaction without savepoints was rolled back and its deliveries run again, in any run")
	}
	for _, c := range rep.Controls {
		rep.Pass = rep.Pass && (c.Pass || c.Skipped != "")
	}
	t.Logf("report:\n%s", table(rep))
	path := os.Getenv("IDEMQ_FAULTS_REPORT")
	if path == "" {
		path = filepath.Join(t.TempDir(), "report.json")
	}
	if err := os.WriteFile(path, []byte(jsonString(rep)+"\n"), 0o644); err != nil {
		t.Errorf("write report: %v", err)
	}
	if tpath := strings.TrimSuffix(path, ".json") + ".txt"; os.Getenv("IDEMQ_FAULTS_REPORT") != "" {
		os.WriteFile(tpath, []byte(table(rep)), 0o644)
	}
	t.Logf("JSON report: %s", path)
	if !rep.Pass {
		t.Errorf("FAIL")
	}
}

// deployment is how a run's Redis and Postgres are deployed.
type deployment struct {
	name      string
	mode      localserver.Persistence
	sentinel  bool
	pgStandby bool
}

// label names the run in subtests, logs and the table: "redis=<name>", or the name alone
// for a run that differs in its Postgres.
func (m deployment) label() string {
	if m.pgStandby {
		return m.name
	}
	return "redis=" + m.name
}

// modes are the deployments a profile runs the nemesis on: Redis as one node without and
// with persistence; in the long profile (or with IDEMQ_FAULTS_SENTINEL=1), a
// Sentinel-monitored Redis master whose Redis faults are failovers; and in the long
// profile (or with IDEMQ_FAULTS_STANDBY=1), "pg-standby": Redis as in "none", Postgres as
// a primary and a synchronous standby that the nemesis promotes.
func modes(p profile) []deployment {
	ms := []deployment{{name: "none", mode: localserver.PersistNone}, {name: "aof-always", mode: localserver.PersistAOFAlways}}
	if p.name == "long" || os.Getenv("IDEMQ_FAULTS_SENTINEL") == "1" {
		ms = append(ms, deployment{name: "sentinel", mode: localserver.PersistNone, sentinel: true})
	}
	if p.name == "long" || os.Getenv("IDEMQ_FAULTS_STANDBY") == "1" {
		ms = append(ms, deployment{name: "pg-standby", mode: localserver.PersistNone, pgStandby: true})
	}
	return ms
}

// sqlDebits runs a worker's debits through database/sql (server.HandleSQLTx over pgx's
// stdlib): half of the nemesis run's workers, and every worker of control (a), so that
// the checker's count of wallet entries judges that path as it judges the pgx one.
var sqlDebits = []string{"IDEMQ_DEBIT_DRIVER=sql"}

func runMain(t *testing.T, p profile, seed uint64, m deployment) runReport {
	modeName := m.label()
	began := time.Now()
	hist := newHistory()
	c := startCluster(t, clusterConfig{mode: m.mode, sentinel: m.sentinel, pgStandby: m.pgStandby, workers: 4, honorKeys: true,
		schedulers: 2,
		workerEnv:  []string{"IDEMQ_UNSAFE_FAULTS=" + faultPoints},
		workerEnvAt: map[int][]string{0: {"IDEMQ_UNSAFE_FAULTS=" + quickFaultPoints, "IDEMQ_CONCURRENCY=8"},
			2: sqlDebits, 3: sqlDebits}}, hist)
	ctx, cancel := context.WithTimeout(context.Background(), p.nemesis+p.drain+5*time.Minute)
	defer cancel()
	jobs := plan(seed, p.jobs, p.spread)

	nemesisDone := make(chan struct{})
	go func() {
		defer close(nemesisDone)
		c.runNemesis(ctx, seed, p.nemesis)
	}()
	driveErr := c.drive(ctx, jobs)
	<-nemesisDone
	c.heal()
	hist.note("heal", "", "")
	// The schedulers run on a little after the heal (a replica restarted by the last
	// fault catches up), then stop: the ticks the checker requires end there.
	time.Sleep(tickStopMargin)
	c.stopSchedulers()
	t.Logf("%s: nemesis over after %s; healed", modeName, time.Since(began).Round(time.Second))
	healed := time.Now()
	r := runReport{Mode: m.name, Postgres: pgSingle, NemesisS: p.nemesis.Seconds()}
	if m.pgStandby {
		r.Postgres = pgSyncStandby
	}
	if err := c.enqueueBad(ctx); err != nil {
		r.Failures = append(r.Failures, err.Error())
	}
	v := c.settle(ctx, p, hist, &r, began, healed)
	var err error
	if r.Ticks, err = c.checkTicks(ctx); err != nil {
		t.Fatalf("checker: ticks: %v", err)
	}
	r.SchedCounters = c.schedCounters()
	hist.mu.Lock()
	for _, l := range hist.lost {
		r.RebootLost = max(r.RebootLost, l.n)
		if l.back < 0 {
			r.RebootBackS = -1
		} else if r.RebootBackS >= 0 {
			r.RebootBackS = max(r.RebootBackS, l.back.Seconds())
		}
	}
	for _, h := range hist.held {
		r.HeldKilled += len(h.keys)
	}
	for _, pr := range hist.promotions {
		r.Promotions = append(r.Promotions, promotionReport{PromotedS: pr.promoted.Seconds(), WritableS: pr.writable.Seconds()})
	}
	hist.mu.Unlock()

	fail := r.fail
	r.checkShared(p, driveErr, c.faultKinds())
	fail(r.RebootBackS >= 0 && r.RebootBackS <= 10, "tasks lost by a reboot (%d) back in Redis after %.1f s, want within 10 s (-1: not within 2 min)", r.RebootLost, r.RebootBackS)
	// The hand-over of held scope locks is a path of its own: a run that never took it
	// proves nothing of it.
	fail(r.Counters["lock:handed"] > 0, "no scope lock was handed over from one delivery to the next")
	fail(r.Counters["ledger:shared_run"] > 0, "no DoTx handler ran in a shared transaction without a savepoint")
	fail(v.Checkouts > 0, "no checkout in the workload: the checkout rule saw nothing")
	fail(v.CheckoutProblems == 0, "%d checkouts break the checkout rule (duplicate charges %d, order rows %d, emails not attributed to an unrecorded receipt %d): %v",
		v.CheckoutProblems, v.DupCheckoutCharges, v.DupOrders, v.DupEmails, firstN(v.CheckoutFailures, 6))
	fail(v.FencedRequests > 0, "no provider request carried its fence: the late-request check saw nothing")
	fail(len(r.ResultOnly) == 0, "%d asynq hashes without a task message (a result written after Redis lost the task): %v", len(r.ResultOnly), r.ResultOnly)
	fail(v.BadArchived == len(badPayloads), "%d of %d bad payloads archived with a reason: %v", v.BadArchived, len(badPayloads), v.BadProblems)
	fail(r.Ticks.pass(), "ticks %s..%s: %d expected, %d missing, %d with duplicate settlements, %d keys not a tick, %d enqueued jobs not settled exactly once: %v",
		r.Ticks.From, r.Ticks.To, r.Ticks.Expected, r.Ticks.Missing, r.Ticks.Duplicated, r.Ticks.NotTick, r.Ticks.Unsettled, firstN(r.Ticks.Breaches, 8))
	for i, pr := range r.Promotions {
		fail(pr.WritableS >= 0, "postgres promotion %d: no write through the multi-host URL within 30 s", i+1)
	}
	r.Pass = len(r.Failures) == 0
	if !r.Pass {
		t.Errorf("%s: %s; examples: %v", modeName, strings.Join(r.Failures, "; "), v.Examples)
	}
	return r
}

// settle drains the run healed at healed and fills r with what every nemesis run reports:
// the drain, the workers' counters, the checker's verdict and the nemesis' history.
func (c *cluster) settle(ctx context.Context, p profile, hist *history, r *runReport, began, healed time.Time) verdict {
	d := c.drain(ctx, p.drain)
	r.Nudges, r.RetryRuns, r.Left10s, r.Left30s, r.LostS = d.nudges, d.retryRuns, d.left10s, d.left30s, d.lostS
	r.DrainS = time.Since(healed).Seconds()
	r.Counters = c.counters()
	v, err := c.check(ctx)
	if err != nil {
		c.t.Fatalf("checker: %v", err)
	}
	r.Verdict, r.DurationS = v, time.Since(began).Seconds()
	r.Nemesis = hist.byKind()
	hist.mu.Lock()
	r.Events, r.Dups, r.DupErrors, r.StopDups = hist.events, hist.dups, hist.dupErrors, hist.stopDups
	r.ResultOnly = hist.resultOnly
	hist.mu.Unlock()
	return v
}

// fail records a failure of the run unless ok.
func (r *runReport) fail(ok bool, format string, args ...any) {
	if !ok {
		r.Failures = append(r.Failures, fmt.Sprintf(format, args...))
	}
}

// checkShared applies the rules every nemesis run keeps: the workload was sent; 30 s
// after the heal every accepted key is in Redis; every recorded key completed, with one
// effect and its result, none lost, stuck, late at the provider or stray; no task left
// over; and every fault kind of kinds injected.
func (r *runReport) checkShared(p profile, driveErr error, kinds []string) {
	v := r.Verdict
	r.fail(driveErr == nil, "workload: %v", driveErr)
	r.fail(r.Left30s[leftMissing] == 0, "%d accepted keys still missing from Redis 30 s after the heal", r.Left30s[leftMissing])
	r.fail(v.Expected == p.jobs, "%d keys recorded, want %d", v.Expected, p.jobs)
	r.fail(v.Completed == v.Expected, "%d of %d keys completed", v.Completed, v.Expected)
	r.fail(v.Lost == 0, "%d keys lost", v.Lost)
	r.fail(v.Stuck == 0, "%d keys stuck", v.Stuck)
	r.fail(v.DuplicateEffects == 0, "%d duplicate effects (charges %d, wallet entries %d)", v.DuplicateEffects, v.DupCharges, v.DupEntries)
	r.fail(v.WrongResult == 0 && v.OlderResult == 0, "%d results name another effect than the one that exists, %d an older charge", v.WrongResult, v.OlderResult)
	r.fail(v.MissingEffect == 0, "%d completed keys without an effect", v.MissingEffect)
	r.fail(v.LateRequests == 0, "%d provider requests arrived after the key was taken over (a request of a higher fence, or its completion, came first)", v.LateRequests)
	r.fail(v.StrayEffects == 0 && v.StrayLedgerRows == 0, "%d effects and %d ledger rows of no expected job", v.StrayEffects, v.StrayLedgerRows)
	r.fail(len(v.Leftover) == 0, "%d asynq tasks neither completed nor deliberately archived: %v", len(v.Leftover), firstN(v.Leftover, 8))
	for _, k := range kinds {
		r.fail(r.Nemesis[k] > 0, "fault %s never injected", k)
	}
}

// drainReport is what drain saw.
type drainReport struct {
	nudges, retryRuns int
	left10s, left30s  map[string]int
	lostS             float64
}

// drain waits, up to bound, until every expected key is completed and no task is left in
// asynq. Test-only nudges keep it short: every 10 s, a key still in progress whose lease
// has ended (its holder died; asynq itself would redeliver only after 60-120 s) gets a
// duplicate delivery, and due-later retries are run now. It classifies what is left 10 s
// and 30 s after it began, and times the return of tasks Redis lost.
func (c *cluster) drain(ctx context.Context, bound time.Duration) (d drainReport) {
	start := time.Now()
	var lastNudge time.Time
	for n := 0; time.Since(start) < bound && ctx.Err() == nil; n++ {
		left, err := c.unsettled(ctx)
		if err == nil {
			if left[leftMissing] > 0 {
				d.lostS = time.Since(start).Seconds()
			}
			if d.left10s == nil && time.Since(start) >= 10*time.Second {
				d.left10s = left
			}
			if d.left30s == nil && time.Since(start) >= 30*time.Second {
				d.left30s = left
			}
		}
		pending, leftover, err := c.settled(ctx)
		if err == nil && pending == 0 && leftover == 0 {
			return
		}
		if time.Since(start) > 10*time.Second && time.Since(lastNudge) > 10*time.Second {
			lastNudge = time.Now()
			rows, err := c.pool.Query(ctx, `SELECT p.idempotency_key FROM processed_jobs p JOIN faults_expected e ON e.key = p.idempotency_key
				WHERE p.status = 'in_progress' AND p.locked_until < now() - interval '1 second'`)
			if err == nil {
				var keys []string
				for rows.Next() {
					var k string
					rows.Scan(&k)
					keys = append(keys, k)
				}
				rows.Close()
				for _, k := range keys {
					if s, err := c.specFor(ctx, k); err == nil && c.enqueueDup(ctx, s, fmt.Sprintf("%s#nudge%d", k, n)) == nil {
						d.nudges++
					}
				}
			}
			if m, err := c.insp.RunAllRetryTasks("default"); err == nil {
				d.retryRuns += m
			}
		}
		time.Sleep(2 * time.Second)
	}
	return
}

// leftMissing is unsettled's class of keys whose task Redis does not hold: lost, and not
// yet republished.
const leftMissing = "task missing from Redis"

// unsettled classifies the expected keys not completed yet: by their ledger row, and by
// the state of the task under their intent's current TaskID ("active" while a worker —
// possibly a killed one, whose task asynq recovers only after 60-120 s — holds it).
func (c *cluster) unsettled(ctx context.Context) (map[string]int, error) {
	rows, err := c.pool.Query(ctx, `SELECT e.key, coalesce(p.status, ''), coalesce(i.state, ''), coalesce(i.queue, ''), coalesce(i.publish_generation, 0)
		FROM faults_expected e
		LEFT JOIN processed_jobs p ON p.idempotency_key = e.key
		LEFT JOIN job_intents i ON i.idempotency_key = e.key
		WHERE p.status IS DISTINCT FROM 'completed'`)
	if err != nil {
		return nil, err
	}
	type row struct {
		key, status, intent, queue string
		gen                        int
	}
	var left []row
	for rows.Next() {
		var r row
		if err := rows.Scan(&r.key, &r.status, &r.intent, &r.queue, &r.gen); err != nil {
			rows.Close()
			return nil, err
		}
		left = append(left, r)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	out := map[string]int{}
	for _, r := range left {
		class := "no intent"
		switch {
		case r.intent == "pending":
			class = "intent pending (not published yet)"
		case r.intent != "":
			id := r.key
			if r.gen > 0 {
				id = fmt.Sprintf("%s#r%d", r.key, r.gen)
			}
			info, err := c.insp.GetTaskInfo(r.queue, id)
			switch {
			case errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound):
				class = leftMissing
			case err != nil:
				return nil, err
			default:
				class = "task " + info.State.String()
			}
		}
		if r.status != "" {
			class += ", ledger " + r.status
		}
		out[class]++
	}
	return out, nil
}

// runNoGuards is negative control (a): the same seed's workload (its first jobs) with the
// ledger and lock off (IDEMQ_UNSAFE_NO_GUARDS: checkouts run unguarded.Checkout, with no
// step records; debits go through database/sql, sqlDebits) and the provider ignoring keys.
// Every checkout is also sent a second time.
// The checker must find duplicate effects, and duplicate order rows or emails of checkouts.
func runNoGuards(t *testing.T, p profile, seed uint64) controlReport {
	r := controlReport{Name: "a: no ledger/lock/step records, provider keys off"}
	hist := newHistory()
	c := startCluster(t, clusterConfig{mode: localserver.PersistNone, workers: 4, honorKeys: false,
		workerEnv: append([]string{"IDEMQ_UNSAFE_NO_GUARDS=true"}, sqlDebits...)}, hist)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	jobs := plan(seed, p.jobs, p.spread)[:p.controlJobs]
	for i := range jobs {
		jobs[i].at /= 4 // same jobs, sent faster
		if jobs[i].checkout != nil && !jobs[i].dup {
			// A second delivery of every checkout: without step records it records
			// a second order and sends a second receipt.
			jobs[i].dup, jobs[i].dupAfter = true, 500*time.Millisecond
		}
	}
	if err := c.drive(ctx, jobs); err != nil {
		r.Failures = append(r.Failures, "workload: "+err.Error())
	}
	c.waitQuiet(ctx, 90*time.Second)
	v, err := c.check(ctx)
	if err != nil {
		t.Fatalf("checker: %v", err)
	}
	r.Verdict, r.Counters = v, c.counters()
	if v.DuplicateEffects == 0 {
		r.Failures = append(r.Failures, "the checker found no duplicate effect with the guards off: it cannot see what they prevent")
	}
	if v.DupEntries == 0 {
		r.Failures = append(r.Failures, "the checker found no duplicate wallet entry of the debits written through database/sql with the guards off: it cannot see what the ledger prevents on that path")
	}
	if v.DupOrders+v.DupEmails == 0 {
		r.Failures = append(r.Failures, fmt.Sprintf("the checker found no duplicate order row and no unattributed email of %d checkouts without step records: it cannot see what the steps prevent", v.Checkouts))
	}
	r.Pass = len(r.Failures) == 0
	if !r.Pass {
		t.Errorf("control %s: %v", r.Name, r.Failures)
	}
	t.Logf("control %s: %d duplicate effects found; checkouts %d: %d duplicate order rows, %d duplicate emails (%d duplicates sent)",
		r.Name, v.DuplicateEffects, v.Checkouts, v.DupOrders, v.DupEmails, hist.dups)
	return r
}

// runNoFencing is negative control (b): fencing off (IDEMQ_UNSAFE_NO_FENCING, a ledger
// switch), provider keys off, and a scripted stale owner: a worker stopped past its lease
// while a duplicate takes its keys over, then resumed. The checker must find duplicates.
func runNoFencing(t *testing.T, p profile, seed uint64) controlReport {
	r := controlReport{Name: "b: fencing off, provider keys off, scripted stale owner"}
	help, _ := runIdemq(nil, "help", "worker")
	if !strings.Contains(help, "IDEMQ_UNSAFE_NO_FENCING") {
		r.Skipped = "the worker has no IDEMQ_UNSAFE_NO_FENCING switch (idempotency.Config.UnsafeNoFencing, to be added by the ledger owner): control (b) cannot run"
		t.Skip(r.Skipped)
		return r
	}
	hist := newHistory()
	c := startCluster(t, clusterConfig{mode: localserver.PersistNone, workers: 2, honorKeys: false, startAfter: 1,
		workerEnv: []string{"IDEMQ_UNSAFE_NO_FENCING=true"}}, hist)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var jobs []job
	for _, j := range plan(seed, p.jobs, 0) {
		if j.charge != nil && len(jobs) < 8 {
			j.dup = false
			jobs = append(jobs, j)
		}
	}
	if err := c.drive(ctx, jobs); err != nil {
		r.Failures = append(r.Failures, "workload: "+err.Error())
	}
	// Wait until worker0 holds charges, stop it, let worker1 take them over.
	var snap map[string]leaseRow
	for deadline := time.Now().Add(30 * time.Second); len(snap) == 0 && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		snap, _ = c.inProgressLeased(ctx)
	}
	w0 := c.workers[0]
	w0.signal(syscall.SIGSTOP, false)
	t0 := time.Now()
	c.startWorker(c.workers[1])
	held := c.heldBy(ctx, snap)
	for _, k := range held {
		if s, err := c.specFor(ctx, k); err == nil {
			c.enqueueDup(ctx, s, k+"#stale")
		}
	}
	// Resume the stale owner just after the first takeover, while the new owner is still
	// inside its provider call (0-3 s): its own completion then races the new owner's.
	for deadline := t0.Add(lease + 4*time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		now, _ := c.inProgressLeased(ctx)
		moved := false
		for _, k := range held {
			if r, ok := now[k]; ok && r.fence != snap[k].fence {
				moved = true
			}
		}
		if moved {
			time.Sleep(300 * time.Millisecond)
			break
		}
	}
	w0.signal(syscall.SIGCONT, false)
	c.hist.note("resume_stale_owner", w0.name, fmt.Sprintf("%s after the stop", time.Since(t0).Round(100*time.Millisecond)))
	c.waitQuiet(ctx, 90*time.Second)
	v, err := c.check(ctx)
	if err != nil {
		t.Fatalf("checker: %v", err)
	}
	r.Verdict, r.Counters = v, c.counters()
	if len(held) == 0 || r.Counters["ledger:takeover"] == 0 {
		r.Failures = append(r.Failures, fmt.Sprintf("no stale owner was scripted: the stopped worker held %d charges, %v takeovers", len(held), r.Counters["ledger:takeover"]))
	}
	if v.DuplicateEffects == 0 && v.WrongResult == 0 {
		r.Failures = append(r.Failures, "the checker found no duplicate effect and no wrong result with fencing off")
	}
	r.Pass = len(r.Failures) == 0
	if !r.Pass {
		t.Errorf("control %s: %v", r.Name, r.Failures)
	}
	return r
}

// runWallClockTicks is negative control (c): two schedulers keying ticks by their wall
// clock (IDEMQ_UNSAFE_SCHEDULE_WALLCLOCK) and one worker. Both are frozen together past two
// ticks (on resuming, each names every missed tick by its own clock reading), then one
// alone across a tick (it names that tick a second late, after the other named it on
// time). The tick rule must find a gap or a key that is no tick.
func runWallClockTicks(t *testing.T) controlReport {
	r := controlReport{Name: "c: schedulers keying ticks by their wall clock"}
	help, _ := runIdemq(nil, "help", "scheduler")
	if !strings.Contains(help, "IDEMQ_UNSAFE_SCHEDULE_WALLCLOCK") {
		r.Skipped = "the scheduler has no IDEMQ_UNSAFE_SCHEDULE_WALLCLOCK switch: control (c) cannot run"
		t.Skip(r.Skipped)
		return r
	}
	hist := newHistory()
	c := startCluster(t, clusterConfig{mode: localserver.PersistNone, workers: 1, honorKeys: true,
		schedulers: 2, schedulerEnv: []string{"IDEMQ_UNSAFE_SCHEDULE_WALLCLOCK=true"}}, hist)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// untilPhase sleeps until the instant d after a tick.
	untilPhase := func(d time.Duration) {
		now := time.Now()
		next := now.Truncate(tickPeriod).Add(d)
		if !next.After(now) {
			next = next.Add(tickPeriod)
		}
		time.Sleep(time.Until(next))
	}
	time.Sleep(tickStartMargin)
	untilPhase(300 * time.Millisecond)
	for _, s := range c.schedulers {
		s.signal(syscall.SIGSTOP, false)
	}
	time.Sleep(2*tickPeriod + 500*time.Millisecond) // two ticks pass; resumed 0.8 s after a tick
	for _, s := range c.schedulers {
		s.signal(syscall.SIGCONT, false)
	}
	hist.note("stop_schedulers", "both", "frozen for 4.5 s")
	untilPhase(tickPeriod - 200*time.Millisecond)
	s0 := c.schedulers[0]
	s0.signal(syscall.SIGSTOP, false)
	time.Sleep(1400 * time.Millisecond) // resumed 1.2 s after the tick the other enqueued
	s0.signal(syscall.SIGCONT, false)
	hist.note("stop_scheduler", s0.name, "frozen for 1.4 s across a tick")
	time.Sleep(tickStopMargin + tickPeriod)
	c.stopSchedulers()
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(500 * time.Millisecond) {
		if n, err := c.cronPending(ctx); err == nil && n == 0 {
			break
		}
	}
	v, err := c.checkTicks(ctx)
	if err != nil {
		t.Fatalf("checker: ticks: %v", err)
	}
	r.Ticks = &v
	if v.Missing+v.Duplicated+v.NotTick == 0 {
		r.Failures = append(r.Failures, fmt.Sprintf("the tick rule found no missing tick, no duplicate and no key that is no tick of %d ticks keyed by the wall clock: it cannot see what scheduled-instant keys prevent", v.Expected))
	}
	r.Pass = len(r.Failures) == 0
	if !r.Pass {
		t.Errorf("control %s: %v", r.Name, r.Failures)
	}
	t.Logf("control %s: ticks %s..%s: %d expected, %d enqueued, %d settlements; %d missing, %d not a tick, %d duplicated; breaches %v",
		r.Name, v.From, v.To, v.Expected, v.Enqueued, v.Settlements, v.Missing, v.NotTick, v.Duplicated, firstN(v.Breaches, 6))
	return r
}

// waitQuiet waits until no task is left in asynq but completed or deliberately archived.
func (c *cluster) waitQuiet(ctx context.Context, bound time.Duration) {
	for deadline := time.Now().Add(bound); time.Now().Before(deadline); time.Sleep(time.Second) {
		if left, _, _, err := c.asynqState(ctx); err == nil && len(left) == 0 {
			return
		}
	}
}

// table prints the report as a table: one column per run, then the controls.
func table(rep *report) string {
	var b strings.Builder
	fmt.Fprintf(&b, "seed %d, profile %s, wall %s\n", rep.Seed, rep.Profile, (time.Duration(rep.WallSeconds) * time.Second).String())
	tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	head := "metric"
	for _, r := range rep.Runs {
		head += "\t" + r.label()
	}
	fmt.Fprintln(tw, head+"\t")
	row := func(name string, f func(r runReport) any) {
		line := name
		for _, r := range rep.Runs {
			line += fmt.Sprintf("\t%v", f(r))
		}
		fmt.Fprintln(tw, line+"\t")
	}
	row("duration (nemesis / drain)", func(r runReport) any {
		return fmt.Sprintf("%.0fs (%.0fs / %.0fs)", r.DurationS, r.NemesisS, r.DrainS)
	})
	row("jobs expected", func(r runReport) any { return r.Verdict.Expected })
	row("completed", func(r runReport) any { return r.Verdict.Completed })
	row("lost", func(r runReport) any { return r.Verdict.Lost })
	row("stuck", func(r runReport) any { return r.Verdict.Stuck })
	row("duplicate effects", func(r runReport) any { return r.Verdict.DuplicateEffects })
	row("checkouts: charges / order rows / emails", func(r runReport) any {
		return fmt.Sprintf("%d: %d / %d / %d", r.Verdict.Checkouts, r.Verdict.CheckoutCharges, r.Verdict.CheckoutOrders, r.Verdict.CheckoutEmails)
	})
	row("excused duplicate emails (unrecorded receipt, attributed)", func(r runReport) any { return r.Verdict.ExcusedEmails })
	row("checkouts breaking the rule (dup charges/orders/emails)", func(r runReport) any {
		return fmt.Sprintf("%d (%d/%d/%d)", r.Verdict.CheckoutProblems, r.Verdict.DupCheckoutCharges, r.Verdict.DupOrders, r.Verdict.DupEmails)
	})
	row("results naming another effect", func(r runReport) any {
		return r.Verdict.WrongResult + r.Verdict.MissingEffect + r.Verdict.OlderResult
	})
	row("claims per key (ledger attempts)", func(r runReport) any { return histogram(r.Verdict.ClaimsPerKey) })
	row("duplicates sent (workload/stop/nudge)", func(r runReport) any {
		return fmt.Sprintf("%d/%d/%d", r.Dups, r.StopDups, r.Nudges)
	})
	row("suppressed by lock (busy)", func(r runReport) any { return r.Counters["lock:busy"] })
	row("locks handed over in a process", func(r runReport) any { return r.Counters["lock:handed"] })
	row("DoTx handlers run in a shared transaction without a savepoint", func(r runReport) any { return r.Counters["ledger:shared_run"] })
	row("… run again after their transaction rolled back", func(r runReport) any { return r.Counters["ledger:shared_rerun"] })
	row("DoTx finishes that found a row changed since their read", func(r runReport) any { return r.Counters["ledger:tx_conflict"] })
	row("locks waited for (held by another process)", func(r runReport) any { return r.Counters["lock:waited"] })
	row("suppressed by ledger: cache hit", func(r runReport) any { return r.Counters["ledger:cache_hit"] })
	row("suppressed by ledger: busy", func(r runReport) any { return r.Counters["ledger:busy"] })
	row("takeovers after lease expiry", func(r runReport) any { return r.Counters["ledger:takeover"] })
	row("fenced completions (lease_lost)", func(r runReport) any { return r.Counters["ledger:lease_lost"] })
	row("self-fenced", func(r runReport) any { return r.Counters["ledger:self_fenced"] })
	row("provider requests by the previous release / this build", func(r runReport) any {
		if r.Mode != "mixed" {
			return "-"
		}
		return fmt.Sprintf("%.0f / %.0f", r.Counters["mixed:provider_requests_previous"], r.Counters["mixed:provider_requests_this"])
	})
	row("provider requests fenced / after a takeover", func(r runReport) any {
		return fmt.Sprintf("%d / %d", r.Verdict.FencedRequests, r.Verdict.LateRequests)
	})
	row("provider keys reused (requests)", func(r runReport) any {
		return fmt.Sprintf("%d (%d)", r.Verdict.KeyReuses, r.Verdict.ReusedRequests)
	})
	row("ticks expected / enqueued / completed / settlements", func(r runReport) any {
		return fmt.Sprintf("%d / %d / %d / %d", r.Ticks.Expected, r.Ticks.Enqueued, r.Ticks.Completed, r.Ticks.Settlements)
	})
	row("ticks missing / duplicated / not a tick", func(r runReport) any {
		return fmt.Sprintf("%d / %d / %d", r.Ticks.Missing, r.Ticks.Duplicated, r.Ticks.NotTick)
	})
	row("scheduler metrics: enqueued / duplicate / caught_up", func(r runReport) any {
		return fmt.Sprintf("%.0f / %.0f / %.0f", r.SchedCounters["schedule:enqueued"], r.SchedCounters["schedule:duplicate"], r.SchedCounters["schedule:caught_up"])
	})
	row("nemesis events", func(r runReport) any { return kinds(r.Nemesis) })
	row("postgres (promotions: promoted / writable after, max)", func(r runReport) any {
		if r.Postgres != pgSyncStandby {
			return r.Postgres
		}
		var promoted, writable float64
		for _, pr := range r.Promotions {
			promoted = max(promoted, pr.PromotedS)
			if writable >= 0 {
				writable = max(writable, pr.WritableS)
			}
			if pr.WritableS < 0 {
				writable = -1 // not within 30 s
			}
		}
		return fmt.Sprintf("sync standby (%d: %.2fs / %.2fs)", len(r.Promotions), promoted, writable)
	})
	row("recovery after kill/stop p50/p95/max (n)", func(r runReport) any {
		return fmt.Sprintf("%.1f/%.1f/%.1fs (%d)", r.Verdict.RecoveryP50, r.Verdict.RecoveryP95, r.Verdict.RecoveryMax, r.Verdict.RecoveryN)
	})
	row("e2e latency p50/p99", func(r runReport) any {
		return fmt.Sprintf("%.2f/%.2fs", r.Verdict.LatencyP50, r.Verdict.LatencyP99)
	})
	row("left 10 s after heal", func(r runReport) any { return kinds(r.Left10s) })
	row("left 30 s after heal", func(r runReport) any { return kinds(r.Left30s) })
	row("lost tasks back in Redis after", func(r runReport) any { return fmt.Sprintf("%.0fs", r.LostS) })
	row("reboot: tasks lost / back after", func(r runReport) any { return fmt.Sprintf("%d / %.1fs", r.RebootLost, r.RebootBackS) })
	row("asynq leftover / bad archived", func(r runReport) any {
		return fmt.Sprintf("%d / %d of %d", len(r.Verdict.Leftover), r.Verdict.BadArchived, len(badPayloads))
	})
	row("asynq hashes without a message", func(r runReport) any { return len(r.ResultOnly) })
	row("result", func(r runReport) any { return passFail(r.Pass) })
	tw.Flush()
	for _, c := range rep.Controls {
		if c.Skipped != "" {
			fmt.Fprintf(&b, "negative control %s: SKIPPED: %s\n", c.Name, c.Skipped)
			continue
		}
		if v := c.Ticks; v != nil {
			fmt.Fprintf(&b, "negative control %s: ticks %s..%s: %d expected, %d enqueued, %d settlements; %d missing, %d keys not a tick, %d duplicated: %s\n",
				c.Name, v.From, v.To, v.Expected, v.Enqueued, v.Settlements, v.Missing, v.NotTick, v.Duplicated, passFail(c.Pass))
			for _, f := range c.Failures {
				fmt.Fprintf(&b, "  FAILURE: %s\n", f)
			}
			continue
		}
		var checkouts string
		if v := c.Verdict; v.Checkouts > 0 {
			checkouts = fmt.Sprintf("; %d checkouts: duplicate charges %d, order rows %d, emails %d (excused %d)",
				v.Checkouts, v.DupCheckoutCharges, v.DupOrders, v.DupEmails, v.ExcusedEmails)
		}
		fmt.Fprintf(&b, "negative control %s: %d duplicate effects found (charges %d, wallet entries %d), %d wrong results, %d results naming an older charge, %d of %d fenced provider requests after a takeover; takeovers %v, fenced completions %v%s: %s\n",
			c.Name, c.Verdict.DuplicateEffects, c.Verdict.DupCharges, c.Verdict.DupEntries, c.Verdict.WrongResult, c.Verdict.OlderResult,
			c.Verdict.LateRequests, c.Verdict.FencedRequests, c.Counters["ledger:takeover"], c.Counters["ledger:lease_lost"], checkouts, passFail(c.Pass))
		for _, f := range c.Failures {
			fmt.Fprintf(&b, "  FAILURE: %s\n", f)
		}
	}
	for _, r := range rep.Runs {
		for id, f := range r.ResultOnly {
			fmt.Fprintf(&b, "%s: asynq hash %q has no message, only fields %s\n", r.label(), id, f)
		}
		for _, f := range r.Failures {
			fmt.Fprintf(&b, "%s FAILURE: %s\n", r.label(), f)
		}
	}
	for _, f := range rep.Failures {
		fmt.Fprintf(&b, "FAILURE: %s\n", f)
	}
	fmt.Fprintf(&b, "overall: %s\n", passFail(rep.Pass))
	return b.String()
}

// label names the run as its deployment's label does.
func (r runReport) label() string {
	if r.Postgres == pgSyncStandby || r.Mode == "mixed" {
		return r.Mode
	}
	return "redis=" + r.Mode
}

func histogram(m map[string]int) string {
	var ks []int
	for k := range m {
		n, _ := strconv.Atoi(k)
		ks = append(ks, n)
	}
	slices.Sort(ks)
	var parts []string
	for _, k := range ks {
		parts = append(parts, fmt.Sprintf("%d:%d", k, m[strconv.Itoa(k)]))
	}
	return strings.Join(parts, " ")
}

func kinds(m map[string]int) string {
	var ks []string
	for k := range m {
		if k != "heal" && k != "lost_back" {
			ks = append(ks, k)
		}
	}
	sort.Strings(ks)
	if len(ks) == 0 {
		return "none"
	}
	var parts []string
	for _, k := range ks {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
	}
	return strings.Join(parts, " ")
}

func passFail(ok bool) string {
	if ok {
		return "PASS"
	}
	return "FAIL"
}

func firstN(s []string, n int) []string { return s[:min(n, len(s))] }

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
