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

	m.takeTurns(func() { m.enqueueDebit(true, d1) },
		turn{d1.Key(), debitSpec(t, d1), other(d1)}, turn{d2.Key(), debitSpec(t, d2), other(d2)})

	if got := m.entries(); got != "wire-new:1 wire-old:1" {
		t.Fatalf("wallet entries per reference: %s; want one each", got)
	}
}
