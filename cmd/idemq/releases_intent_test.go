package main

import (
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/tasks"
)

// ownSpec is the Spec of key's intent as recorded: its task type, queue and payload bytes,
// whichever release wrote it. A task of it under TaskID key or key#r<n> is the intent's
// own task.
func (m *mixed) ownSpec(key string) outbox.Spec {
	m.t.Helper()
	var s outbox.Spec
	if err := m.pool.QueryRow(m.ctx, `SELECT task_type, payload, queue FROM job_intents WHERE idempotency_key = $1`, key).Scan(&s.Type, &s.Payload, &s.Queue); err != nil {
		m.t.Fatalf("intent %s: %v", key, err)
	}
	s.Key, s.MaxRetry, s.Timeout, s.Retention = key, tasks.DefaultMaxRetry, 30*time.Second, time.Hour
	return s
}

// An accepted job whose task Redis lost is republished by the other release's reconciler
// under TaskID key#r1, and completed once by a worker of the release that accepted it,
// which settles the intent: the newest release's intent, republished by this commit, and
// this commit's, republished by the release. The reconciler runs in the workers of both;
// the one that republishes serves another queue, so that it only reconciles. Redis's loss
// is the task deleted and the queue's epoch marker with it, which makes every release's
// reconciler look at once.
func TestReleasesRepublishEachOthersIntents(t *testing.T) {
	t.Parallel()
	m := startMixed(t, 3*time.Minute)
	m.migrate()
	for _, writer := range []bool{true, false} {
		d := tasks.Debit{AccountID: "acct-r", AmountCents: 300, Reference: "lost-" + strings.ReplaceAll(m.name(writer), " ", "-")}
		m.enqueueDebit(writer, d)
		m.lose(d.Key())
		m.loseQueue()

		rec := m.worker(!writer, "IDEMQ_QUEUES=elsewhere")
		m.waitFor("the republish of "+d.Key(), func() bool { return m.intent(d.Key()) == "published gen=1" })
		info, err := m.insp.GetTaskInfo(tasks.Queue, d.Key()+"#r1")
		if err != nil || info.State.String() != "pending" {
			t.Fatalf("%s's reconciler republished %s: task %s#r1 %v %v, want pending", m.name(!writer), d.Key(), d.Key(), info, err)
		}
		m.stop(rec)

		w := m.worker(writer)
		m.waitTask(d.Key()+"#r1", "completed")
		if got := m.waitIntent(d.Key(), "done"); got != "done gen=1" {
			t.Errorf("%s's intent of %s after %s's worker completed its republished task: %s, want done gen=1", m.name(writer), d.Key(), m.name(writer), got)
		}
		m.stop(w)
	}
	if got := m.entries(); got != "lost-this-commit:1 lost-"+m.r.Version+":1" {
		t.Fatalf("wallet entries per reference: %s; want one each", got)
	}
}

// The rule that settles an intent holds across releases: a delivery of the intent's own
// task settles it whichever release recorded the intent and whichever completes the task,
// and this commit never settles an intent when another payload completes its key (under
// the intent's very TaskID: only the payload's checksum tells them apart); the intent's
// own task is then refused as a mismatch, and the intent ends dead with that reason.
//
// The newest release settles by key (its finish and its reconciler both settle every
// intent whose key is completed): beside it, another payload completing the key settles
// this commit's intent done although its payload never ran. The last subtest shows it,
// and skips while it holds (see docs/releases.md).
func TestReleasesSettleEachOthersIntents(t *testing.T) {
	t.Parallel()
	m := startMixed(t, 3*time.Minute)
	m.migrate()
	for _, writer := range []bool{true, false} {
		d := tasks.Debit{AccountID: "acct-s", AmountCents: 400, Reference: "own-" + strings.ReplaceAll(m.name(writer), " ", "-")}
		m.enqueueDebit(writer, d)
		w := m.worker(!writer)
		m.waitTask(d.Key(), "completed")
		if got := m.waitIntent(d.Key(), "done"); got != "done gen=0" {
			t.Errorf("%s's intent of %s, its task completed by %s: %s, want done gen=0", m.name(writer), d.Key(), m.name(!writer), got)
		}
		m.stop(w)
	}

	// takeKey records an intent through writer's enqueue, loses its task, and has a worker
	// of completer complete another payload under the intent's TaskID; it returns the
	// intent's state then. (It fails m.t: the test's, or the subtest's below.)
	takeKey := func(writer, completer bool, ref string) (tasks.Debit, string) {
		m.t.Helper()
		d := tasks.Debit{AccountID: "acct-s", AmountCents: 500, Reference: ref}
		m.enqueueDebit(writer, d)
		m.lose(d.Key())
		w := m.worker(completer)
		p := d
		p.AmountCents++
		m.send(debitSpec(m.t, p), d.Key(), "completed")
		got := m.intent(d.Key())
		m.stop(w)
		return d, got
	}

	// This commit's worker leaves the release's intent published, then refuses its own
	// task (as the reconciler republishes it) and settles it dead.
	d, got := takeKey(true, false, "taken-old")
	if got != "published gen=0" {
		t.Errorf("%s's intent of %s after this commit completed another payload under its TaskID: %s, want published gen=0", m.r.Version, d.Key(), got)
	}
	w := m.worker(false)
	m.send(m.ownSpec(d.Key()), d.Key()+"#r1", "archived")
	if got := m.waitIntent(d.Key(), "dead"); !strings.Contains(got, "mismatch") {
		t.Errorf("%s's intent of %s after this commit refused its own task: %s, want dead for a mismatch", m.r.Version, d.Key(), got)
	}
	m.stop(w)
	if got := m.entries(); got != "own-this-commit:1 own-"+m.r.Version+":1 taken-old:1" {
		t.Errorf("wallet entries per reference: %s; want one each", got)
	}

	t.Run("release settles by key", func(t *testing.T) {
		m.t = t
		var found []string
		// Its worker: the completion of another payload settles this commit's intent.
		d, got := takeKey(false, true, "taken-new")
		if strings.HasPrefix(got, "done ") {
			found = append(found, m.r.Version+"'s worker settled this commit's intent of "+d.Key()+" done when it completed another payload under the intent's TaskID")
		} else if got != "published gen=0" {
			t.Fatalf("this commit's intent of %s after %s completed another payload under its TaskID: %s, want published gen=0", d.Key(), m.r.Version, got)
		}
		// Its reconciler: a key this commit completed with another payload settles the
		// intent on the release's next round, where this commit's republishes it.
		d, got = takeKey(false, false, "taken-rec")
		if got != "published gen=0" {
			t.Fatalf("this commit's intent of %s after this commit completed another payload under its TaskID: %s, want published gen=0", d.Key(), got)
		}
		m.loseQueue()
		rec := m.worker(true, "IDEMQ_QUEUES=elsewhere")
		m.waitFor("a reconcile round of "+d.Key(), func() bool { got = m.intent(d.Key()); return got != "published gen=0" })
		m.stop(rec)
		if strings.HasPrefix(got, "done ") {
			found = append(found, m.r.Version+"'s reconciler settled this commit's intent of "+d.Key()+" done because its key was completed, by another payload")
		} else if got != "published gen=1" {
			t.Fatalf("this commit's intent of %s after %s's reconcile round: %s, want published gen=1 (republished)", d.Key(), m.r.Version, got)
		}
		if len(found) > 0 {
			// A known difference of the release's, documented in docs/releases.md: logged,
			// not skipped, so that a run under CI skips nothing.
			t.Logf("%s settles intents by key, not by their own task: %s", m.r.Version, strings.Join(found, "; "))
		}
	})
}
