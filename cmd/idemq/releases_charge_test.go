package main

import (
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// A leased job's ledger row, written by either release, answers the other's duplicate: the
// newest release and this commit take turns as the only worker, charges come from the
// release's enqueue and from a plain asynq producer, and the provider (which charges again
// for a repeated Idempotency-Key here) is called once per order. A delivery of another
// payload under a charged order's key is archived as a mismatch by either release.
func TestReleasesAnswerEachOthersCharges(t *testing.T) {
	t.Parallel()
	m := startMixed(t, 3*time.Minute)
	m.migrate()
	m.startFakepay("IDEMQ_FAKEPAY_HONOR_KEYS=false")
	c1 := tasks.Charge{OrderID: "wire-old", CustomerID: "cust-w", AmountCents: 4200, Currency: "EUR"}
	c2 := tasks.Charge{OrderID: "wire-new", CustomerID: "cust-w", AmountCents: 1700, Currency: "EUR"}
	other := func(c tasks.Charge) outbox.Spec { c.AmountCents++; return chargeSpec(t, c) }

	m.takeTurns(func() {
		out := m.runOld("enqueue", "charge", "--order-id", c1.OrderID, "--customer-id", c1.CustomerID, "--amount-cents", "4200", "--currency", "EUR")
		if !strings.Contains(out, c1.Key()) {
			t.Fatalf("%s enqueue: %s", m.r.Version, out)
		}
	}, turn{c1.Key(), chargeSpec(t, c1), other(c1)}, turn{c2.Key(), chargeSpec(t, c2), other(c2)})

	if got := m.charges(); got != "wire-new:1 wire-old:1" {
		t.Errorf("provider charges per order: %s; want one each", got)
	}
	requests := strings.Join(testenv.Strings(t, m.pool, `SELECT idempotency_key || ':' || count(*) FROM fakepay_requests GROUP BY idempotency_key ORDER BY 1`), " ")
	if requests != "charge:wire-new:1 charge:wire-old:1" {
		t.Errorf("provider requests per key: %s; want one each (every duplicate answered from the ledger)", requests)
	}
	if n := testenv.Count(t, m.pool, `SELECT count(*) FROM processed_jobs p JOIN fakepay_charges c ON c.id = p.result->>'charge_id'
		WHERE p.status = 'completed' AND p.idempotency_key = 'charge:' || c.order_id`); n != 2 {
		t.Errorf("%d completed rows name their order's charge, want 2", n)
	}
}

// A charge claimed by one release's worker, which is killed after the provider charged
// and before it heard the answer, is taken over by the other release's worker once the
// lease has run out: it calls the provider again with the same Idempotency-Key, gets the
// first charge back, and completes the key with it. Both directions.
func TestReleasesTakeOverEachOthersCharges(t *testing.T) {
	t.Parallel()
	m := startMixed(t, 3*time.Minute)
	m.migrate()
	provider := m.startFakepay("IDEMQ_FAKEPAY_HONOR_KEYS=true")
	// The proxy holds each answer 4 s after the provider charged: the kill lands between
	// the effect and the completion. An 8 s lease leaves the call its time (see
	// TestEndToEndWorkerKilledMidCharge); the 2 s lock lets the next worker in soon.
	held := holdAnswers(t, provider, 4*time.Second)
	lease := []string{"IDEMQ_LEASE=8s", "IDEMQ_LOCK_TTL=2s"}
	for _, first := range []bool{true, false} {
		c := tasks.Charge{OrderID: "killed-" + strings.ReplaceAll(m.name(first), " ", "-"), CustomerID: "cust-k", AmountCents: 4200, Currency: "EUR"}
		spec := chargeSpec(t, c)
		w := m.worker(first, append(lease, "IDEMQ_FAKEPAY_URL="+held)...)
		m.publish(spec, c.Key())
		m.waitFor("the provider's charge of "+c.OrderID, func() bool {
			return testenv.Count(t, m.pool, `SELECT count(*) FROM fakepay_charges WHERE order_id = $1`, c.OrderID) > 0
		})
		m.kill(w)
		status := testenv.Strings(t, m.pool, `SELECT status FROM processed_jobs WHERE idempotency_key = $1`, c.Key())
		if len(status) != 1 || status[0] != "in_progress" {
			t.Fatalf("%s killed mid-charge: the key is %v, want in_progress", m.name(first), status)
		}

		// asynq would redeliver only after its own recovery (a minute or more): a
		// duplicate under another TaskID makes the other release take over.
		start := time.Now()
		w = m.worker(!first, lease...)
		m.send(spec, c.Key()+"#dup", "completed")
		m.stop(w)

		var charges, attempts, requests int
		var chargeID, resultID string
		m.pool.QueryRow(m.ctx, `SELECT count(*), min(id) FROM fakepay_charges WHERE order_id = $1`, c.OrderID).Scan(&charges, &chargeID)
		m.pool.QueryRow(m.ctx, `SELECT coalesce(result->>'charge_id', ''), attempts FROM processed_jobs WHERE idempotency_key = $1`, c.Key()).Scan(&resultID, &attempts)
		m.pool.QueryRow(m.ctx, `SELECT count(*) FROM fakepay_requests WHERE idempotency_key = $1`, c.Key()).Scan(&requests)
		if charges != 1 || resultID != chargeID || attempts < 2 || requests < 2 {
			t.Fatalf("%s killed, %s took over: charges %d, ledger result names %q, provider made %q, attempts %d, provider requests %d; "+
				"want one charge named by the result after a takeover that called the provider again",
				m.name(first), m.name(!first), charges, resultID, chargeID, attempts, requests)
		}
		t.Logf("%s killed mid-charge, %s took over in %s: %d provider requests, one charge, %d attempts",
			m.name(first), m.name(!first), time.Since(start).Round(100*time.Millisecond), requests, attempts)
	}
}
