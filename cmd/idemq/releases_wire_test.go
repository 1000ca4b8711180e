package main

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/internal/release"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// What one release writes, the other reads: the newest release and this commit take turns
// as the only worker on one schema. A debit completed by either (its ledger row, written
// by its own transactional protocol, and its payload's fingerprint) is answered from the
// ledger when the other gets a duplicate delivery from a plain asynq producer (no second
// wallet entry, the task completed), and a delivery of another payload under its key is
// refused (no entry, the task archived, not completed). The tasks carry this commit's
// headers (first-enqueue time); the release's jobs are enqueued through its own outbox.
func TestReleasesReadEachOthersRecords(t *testing.T) {
	t.Parallel()
	rs := release.List()
	r := rs[len(rs)-1]
	old := testenv.ReleaseBinary(t, r)
	takeStackSlot(t)
	ctx := testenv.Context(t, 3*time.Minute)
	dsn := testenv.EmptyPostgresURL(t)
	pool := testenv.Pool(t, dsn)
	rurl := testenv.RedisURL(t)
	rdb := testenv.RedisClient(t, rurl)
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	env := []string{"DATABASE_URL=" + dsn, "REDIS_URL=" + rurl, "IDEMQ_METRICS_ADDR=", "IDEMQ_SHUTDOWN_TIMEOUT=5s"}
	runOld := releaseRunner(t, ctx, r, old, env)
	runOld("migrate")
	if out, stderr, err := idemq(t, env, "migrate"); err != nil {
		t.Fatalf("this commit's migrate after %s's: %v\n%s%s", r.Version, err, out, stderr)
	}
	stop := func(p *proc) {
		t.Helper()
		p.signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-ctx.Done():
			t.Fatalf("%s did not stop on SIGTERM", p.name)
		}
	}
	// send delivers d straight to asynq under taskID, as a plain producer would, and
	// waits until the task is completed (want "completed") or archived.
	send := func(d tasks.Debit, taskID, want string) {
		t.Helper()
		spec, err := tasks.DebitSpec(d)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := client.EnqueueContext(ctx, spec.Task(taskID, time.Now(), asynq.Retention(time.Hour))); err != nil {
			t.Fatal(err)
		}
		var info *asynq.TaskInfo
		waitUntil(t, ctx, fmt.Sprintf("task %s %s", taskID, want), func() bool {
			info, err = insp.GetTaskInfo(spec.Queue, taskID)
			return err == nil && (info.State == asynq.TaskStateCompleted || info.State == asynq.TaskStateArchived)
		})
		if info.State.String() != want {
			t.Fatalf("task %s: %s (%s), want %s", taskID, info.State, info.LastErr, want)
		}
		if want == "archived" && !strings.Contains(info.LastErr, "another payload") {
			t.Errorf("task %s archived for %q, want a payload mismatch", taskID, info.LastErr)
		}
	}
	entries := func() string {
		t.Helper()
		return strings.Join(testenv.Strings(t, pool, "SELECT reference || ':' || count(*) FROM wallet_entries GROUP BY reference ORDER BY reference"), " ")
	}
	d1 := tasks.Debit{AccountID: "acct-w", AmountCents: 125, Reference: "wire-old"}
	d2 := tasks.Debit{AccountID: "acct-w", AmountCents: 75, Reference: "wire-new"}
	other := func(d tasks.Debit) tasks.Debit { d.AmountCents++; return d }

	// The release completes d1, through its own outbox.
	w := startBinary(t, old, "worker-"+r.Version, env, "worker")
	if out := runOld("enqueue", "debit", "--account-id", d1.AccountID, "--amount-cents", "125", "--reference", d1.Reference); !strings.Contains(out, d1.Key()) {
		t.Fatalf("%s enqueue: %s", r.Version, out)
	}
	waitCompletedKey(t, ctx, pool, d1.Key())
	stop(w)

	// This commit reads the release's row: a duplicate is answered, another payload refused.
	w = startIdemq(t, "worker-head", env, "worker")
	send(d1, d1.Key()+"#dup-head", "completed")
	send(other(d1), d1.Key()+"#other-head", "archived")
	send(d2, d2.Key(), "completed")
	stop(w)

	// The release reads this commit's row, as it did its own before.
	w = startBinary(t, old, "worker-"+r.Version, env, "worker")
	send(d2, d2.Key()+"#dup-old", "completed")
	send(other(d2), d2.Key()+"#other-old", "archived")
	send(d1, d1.Key()+"#dup-old", "completed")
	stop(w)

	if got := entries(); got != "wire-new:1 wire-old:1" {
		t.Fatalf("wallet entries per reference: %s; want one each", got)
	}
}
