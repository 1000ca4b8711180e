package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/release"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// mixed is one schema and one Redis database on which the newest release's processes and
// this commit's take turns or run side by side: what the cross-release tests run on.
type mixed struct {
	t      *testing.T
	ctx    context.Context
	r      release.Release
	old    string   // the release's binary
	env    []string // every process's: the database, Redis, no metrics server
	pool   *pgxpool.Pool
	rdb    *redis.Client
	client *asynq.Client
	insp   *asynq.Inspector
	runOld func(args ...string) string // a one-shot command of the release
}

// startMixed builds (or finds) the newest release's binary, waits for the stack slot and
// readies an empty schema and a Redis database for d; nothing is migrated yet.
func startMixed(t *testing.T, d time.Duration) *mixed {
	t.Helper()
	rs := release.List()
	m := &mixed{t: t, r: rs[len(rs)-1]}
	m.old = testenv.ReleaseBinary(t, m.r)
	takeStackSlot(t)
	m.ctx = testenv.Context(t, d)
	dsn := testenv.EmptyPostgresURL(t)
	m.pool = testenv.Pool(t, dsn)
	rurl := testenv.RedisURL(t)
	m.rdb = testenv.RedisClient(t, rurl)
	m.client = asynq.NewClientFromRedisClient(m.rdb)
	m.insp = asynq.NewInspectorFromRedisClient(m.rdb)
	m.env = []string{"DATABASE_URL=" + dsn, "REDIS_URL=" + rurl, "IDEMQ_METRICS_ADDR=", "IDEMQ_SHUTDOWN_TIMEOUT=5s"}
	m.runOld = releaseRunner(t, m.ctx, m.r, m.old, m.env)
	return m
}

// migrate has the release migrate the schema, then this commit carry it over: the schema
// of a rolling upgrade's middle.
func (m *mixed) migrate() {
	m.t.Helper()
	m.runOld("migrate")
	m.runNew("migrate")
}

// runNew runs a one-shot command of this commit and returns its output, failing the test
// when it fails.
func (m *mixed) runNew(args ...string) string {
	m.t.Helper()
	out, stderr, err := idemq(m.t, m.env, args...)
	if err != nil {
		m.t.Fatalf("this commit's %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr)
	}
	return out
}

// run runs a one-shot command of the release (old) or of this commit.
func (m *mixed) run(old bool, args ...string) string {
	m.t.Helper()
	if old {
		return m.runOld(args...)
	}
	return m.runNew(args...)
}

// name is how the test's messages and logs name the release (old) or this commit.
func (m *mixed) name(old bool) string {
	if old {
		return m.r.Version
	}
	return "this commit"
}

// startFakepay starts this commit's payment provider on the schema (the provider is not
// part of a release: it records the fence this commit's workers send, and takes the
// release's requests, which carry none) with env, and points every worker started later
// at it. It returns its URL.
func (m *mixed) startFakepay(env ...string) string {
	m.t.Helper()
	port := testenv.FreePort(m.t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startIdemq(m.t, "fakepay", append([]string{m.env[0], fmt.Sprintf("IDEMQ_FAKEPAY_ADDR=127.0.0.1:%d", port)}, env...), "fakepay")
	testenv.WaitHTTP(m.t, url+"/healthz", 20*time.Second)
	m.env = append(m.env, "IDEMQ_FAKEPAY_URL="+url)
	return url
}

// worker starts a worker of the release (old) or of this commit, with env after the
// common environment (a later value wins).
func (m *mixed) worker(old bool, env ...string) *proc {
	m.t.Helper()
	env = append(append([]string{}, m.env...), env...)
	if old {
		return startBinary(m.t, m.old, "worker-"+m.r.Version, env, "worker")
	}
	return startIdemq(m.t, "worker-head", env, "worker")
}

// waitFor polls ok until it holds, failing the test after 30 s (or when the test's
// context ends first).
func (m *mixed) waitFor(what string, ok func() bool) {
	m.t.Helper()
	ctx, cancel := context.WithTimeout(m.ctx, 30*time.Second)
	defer cancel()
	waitUntil(m.t, ctx, what, ok)
}

// stop stops p with SIGTERM and waits for it.
func (m *mixed) stop(p *proc) {
	m.t.Helper()
	p.signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-m.ctx.Done():
		m.t.Fatalf("%s did not stop on SIGTERM", p.name)
	}
}

// kill stops p with SIGKILL and waits for it.
func (m *mixed) kill(p *proc) {
	m.t.Helper()
	p.signal(syscall.SIGKILL)
	<-p.done
}

// publish puts spec's task into asynq under taskID, as a plain producer would.
func (m *mixed) publish(spec outbox.Spec, taskID string) {
	m.t.Helper()
	if _, err := m.client.EnqueueContext(m.ctx, spec.Task(taskID, time.Now(), asynq.Retention(time.Hour))); err != nil {
		m.t.Fatalf("publish %s: %v", taskID, err)
	}
}

// send publishes spec's task under taskID and waits until it ends as want ("completed",
// or "archived", which must be for a payload mismatch).
func (m *mixed) send(spec outbox.Spec, taskID, want string) {
	m.t.Helper()
	m.publish(spec, taskID)
	m.waitTask(taskID, want)
}

// waitTask waits until the task taskID is completed or archived, and fails the test
// unless it ended as want; an archived task must have been refused for its payload.
func (m *mixed) waitTask(taskID, want string) {
	m.t.Helper()
	var info *asynq.TaskInfo
	var err error
	m.waitFor(fmt.Sprintf("task %s %s", taskID, want), func() bool {
		info, err = m.insp.GetTaskInfo(tasks.Queue, taskID)
		return err == nil && (info.State == asynq.TaskStateCompleted || info.State == asynq.TaskStateArchived)
	})
	if info.State.String() != want {
		m.t.Fatalf("task %s: %s (%s), want %s", taskID, info.State, info.LastErr, want)
	}
	if want == "archived" && !strings.Contains(info.LastErr, "another payload") {
		m.t.Errorf("task %s archived for %q, want a payload mismatch", taskID, info.LastErr)
	}
}

// lose deletes the task taskID from asynq, as Redis losing it would.
func (m *mixed) lose(taskID string) {
	m.t.Helper()
	m.waitFor("task "+taskID+" in Redis", func() bool {
		_, err := m.insp.GetTaskInfo(tasks.Queue, taskID)
		return err == nil
	})
	if err := m.insp.DeleteTask(tasks.Queue, taskID); err != nil {
		m.t.Fatalf("delete task %s: %v", taskID, err)
	}
}

// loseQueue deletes the queue's epoch marker, as Redis losing its data does: the
// reconciler of every release (all probe the marker every 2 s) then checks the queue's
// published intents at once instead of after the grace period and the 30-second round.
func (m *mixed) loseQueue() {
	m.t.Helper()
	if err := m.rdb.Del(m.ctx, "idemq:{"+tasks.Queue+"}:epoch").Err(); err != nil {
		m.t.Fatal(err)
	}
}

// intent returns key's outbox intent as "state gen=N", with ": last_error" when it has one.
func (m *mixed) intent(key string) string {
	m.t.Helper()
	rows := testenv.Strings(m.t, m.pool, `SELECT state || ' gen=' || publish_generation || coalesce(': ' || last_error, '')
		FROM job_intents WHERE idempotency_key = $1`, key)
	if len(rows) != 1 {
		return "none"
	}
	return rows[0]
}

// waitIntent waits until key's intent's state (intent's answer up to the generation) is
// state, and returns intent's answer.
func (m *mixed) waitIntent(key, state string) string {
	m.t.Helper()
	var got string
	m.waitFor(fmt.Sprintf("intent %s %s", key, state), func() bool {
		got = m.intent(key)
		return strings.HasPrefix(got, state+" ")
	})
	return got
}

// entries returns the wallet entries per reference, as "reference:count" in reference
// order.
func (m *mixed) entries() string {
	m.t.Helper()
	return strings.Join(testenv.Strings(m.t, m.pool, "SELECT reference || ':' || count(*) FROM wallet_entries GROUP BY reference ORDER BY reference"), " ")
}

// charges returns the provider's charges per order, as "order:count" in order order.
func (m *mixed) charges() string {
	m.t.Helper()
	return strings.Join(testenv.Strings(m.t, m.pool, "SELECT order_id || ':' || count(*) FROM fakepay_charges GROUP BY order_id ORDER BY order_id"), " ")
}

// enqueueDebit records d's intent through the enqueue command of the release (old) or of
// this commit, which publishes its task at once.
func (m *mixed) enqueueDebit(old bool, d tasks.Debit) {
	m.t.Helper()
	out := m.run(old, "enqueue", "debit", "--account-id", d.AccountID, "--amount-cents", strconv.FormatInt(d.AmountCents, 10), "--reference", d.Reference)
	if !strings.Contains(out, d.Key()) {
		m.t.Fatalf("%s enqueue: %s", m.name(old), out)
	}
}

// chargeSpec is c's Spec, failing the test when c is invalid.
func chargeSpec(t *testing.T, c tasks.Charge) outbox.Spec {
	t.Helper()
	spec, err := tasks.ChargeSpec(c)
	if err != nil {
		t.Fatal(err)
	}
	return spec
}

// debitSpec is d's Spec, failing the test when d is invalid.
func debitSpec(t *testing.T, d tasks.Debit) outbox.Spec {
	t.Helper()
	spec, err := tasks.DebitSpec(d)
	if err != nil {
		t.Fatal(err)
	}
	return spec
}

// turn is one job of takeTurns: its key, its spec, and a spec of another payload under
// its key.
type turn struct {
	key         string
	spec, other outbox.Spec
}

// takeTurns has the release complete first (started by enqueueOld, through its own
// outbox); then this commit's worker answer a duplicate of first from the release's row,
// archive another payload under its key and complete second; then the release's worker
// do the same to second's row (and answer first's again). The duplicates come from a plain
// asynq producer.
func (m *mixed) takeTurns(enqueueOld func(), first, second turn) {
	m.t.Helper()
	w := m.worker(true)
	enqueueOld()
	waitCompletedKey(m.t, m.ctx, m.pool, first.key)
	m.stop(w)

	w = m.worker(false)
	m.send(first.spec, first.key+"#dup-head", "completed")
	m.send(first.other, first.key+"#other-head", "archived")
	m.send(second.spec, second.key, "completed")
	m.stop(w)

	w = m.worker(true)
	m.send(second.spec, second.key+"#dup-old", "completed")
	m.send(second.other, second.key+"#other-old", "archived")
	m.send(first.spec, first.key+"#dup-old", "completed")
	m.stop(w)
}
