package main

import (
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency/outbox"
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
	m := startMixed(t, 3*time.Minute)
	m.migrate()
	d1 := tasks.Debit{AccountID: "acct-w", AmountCents: 125, Reference: "wire-old"}
	d2 := tasks.Debit{AccountID: "acct-w", AmountCents: 75, Reference: "wire-new"}
	other := func(d tasks.Debit) outbox.Spec { d.AmountCents++; return debitSpec(t, d) }

	// The release completes d1, through its own outbox.
	w := m.worker(true)
	m.enqueueDebit(true, d1)
	waitCompletedKey(t, m.ctx, m.pool, d1.Key())
	m.stop(w)

	// This commit reads the release's row: a duplicate is answered, another payload refused.
	w = m.worker(false)
	m.send(debitSpec(t, d1), d1.Key()+"#dup-head", "completed")
	m.send(other(d1), d1.Key()+"#other-head", "archived")
	m.send(debitSpec(t, d2), d2.Key(), "completed")
	m.stop(w)

	// The release reads this commit's row, as it did its own before.
	w = m.worker(true)
	m.send(debitSpec(t, d2), d2.Key()+"#dup-old", "completed")
	m.send(other(d2), d2.Key()+"#other-old", "archived")
	m.send(debitSpec(t, d1), d1.Key()+"#dup-old", "completed")
	m.stop(w)

	if got := m.entries(); got != "wire-new:1 wire-old:1" {
		t.Fatalf("wallet entries per reference: %s; want one each", got)
	}
}
