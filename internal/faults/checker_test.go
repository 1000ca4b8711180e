//go:build faults

package faults

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/tasks"
)

// verdict is what the offline checker found in the database and in asynq.
type verdict struct {
	Expected         int `json:"jobs_expected"`
	Completed        int `json:"completed"`
	Lost             int `json:"lost"`              // no ledger row at all
	Stuck            int `json:"stuck"`             // a row that is not completed
	WrongResult      int `json:"wrong_result"`      // completed, but the result does not name the one effect
	MissingEffect    int `json:"missing_effect"`    // completed with no effect
	DuplicateEffects int `json:"duplicate_effects"` // effects beyond one per job (charges + entries)
	DupCharges       int `json:"duplicate_charges"`
	DupEntries       int `json:"duplicate_wallet_entries"`
	StrayEffects     int `json:"stray_effects"` // effects of no expected job
	// OlderResult counts charges whose stored result names an older charge of the order
	// than its newest: a stale owner's completion won over the owner that took it over.
	OlderResult     int            `json:"result_names_older_charge"`
	StrayLedgerRows int            `json:"stray_ledger_rows"`          // of no expected job; periodic jobs are checkTicks'
	KeyReuses       int            `json:"provider_keys_reused"`       // idempotency keys sent to the provider more than once
	ReusedRequests  int            `json:"provider_requests_replayed"` // requests the provider answered from an earlier charge
	ClaimsPerKey    map[string]int `json:"claims_per_key_histogram"`   // ledger attempts per key → keys
	LatencyP50      float64        `json:"e2e_latency_p50_s"`
	LatencyP99      float64        `json:"e2e_latency_p99_s"`
	RecoveryN       int            `json:"recovery_samples"`
	RecoveryP50     float64        `json:"recovery_p50_s"`
	RecoveryP95     float64        `json:"recovery_p95_s"`
	RecoveryMax     float64        `json:"recovery_max_s"`
	Leftover        []string       `json:"asynq_leftover"` // tasks neither completed nor (deliberately) archived
	BadArchived     int            `json:"bad_payloads_archived"`
	BadProblems     []string       `json:"bad_payload_problems,omitempty"`
	Examples        []string       `json:"examples,omitempty"` // a few offending keys

	// FencedRequests counts the provider requests that carried their claim's fence;
	// LateRequests those received after a request of a higher fence for the same key, or
	// after a higher fence completed the key: a stale owner's call that landed after the
	// key was taken over, although a takeover waits for the lease to end and a call ends
	// inside its lease.
	FencedRequests int `json:"provider_requests_fenced"`
	LateRequests   int `json:"provider_requests_after_takeover"`

	// The checkouts (order:checkout, three recorded steps; see judgeCheckout): their
	// effects in all, those beyond one per checkout, and the receipt emails sent again by
	// a claim that did not record its receipt step, each attributed by its fence.
	Checkouts          int `json:"checkouts_expected"`
	CheckoutCharges    int `json:"checkout_charges"`
	CheckoutOrders     int `json:"checkout_order_rows"`
	CheckoutEmails     int `json:"checkout_emails"`
	DupCheckoutCharges int `json:"duplicate_checkout_charges"`
	DupOrders          int `json:"duplicate_order_rows"`
	DupEmails          int `json:"duplicate_emails_unattributed"`
	ExcusedEmails      int `json:"excused_duplicate_emails"` // unrecorded receipt, attributed
	// CheckoutProblems counts the checkouts that break the rule, CheckoutFailures says
	// how (the first 20 messages, each naming the order and the fences).
	CheckoutProblems int      `json:"checkout_problems"`
	CheckoutFailures []string `json:"checkout_failures,omitempty"`
}

type effects struct {
	count int
	ids   []string
}

// check reads the final state. It never mutates anything.
func (c *cluster) check(ctx context.Context) (verdict, error) {
	var v verdict
	charges, err := c.effects(ctx, `SELECT order_id, id FROM fakepay_charges ORDER BY created_at, id`)
	if err != nil {
		return v, err
	}
	entries, err := c.effects(ctx, `SELECT reference, id::text FROM wallet_entries ORDER BY id`)
	if err != nil {
		return v, err
	}
	rows, err := c.pool.Query(ctx, `SELECT e.key, e.kind, e.ref, coalesce(p.status, ''), coalesce(p.attempts, 0),
			coalesce(p.result->>'charge_id', p.result->>'entry_id', ''), coalesce(p.result->>'order_row', ''),
			coalesce(p.result->>'email_id', ''), p.completed_at, i.created_at
		FROM faults_expected e
		LEFT JOIN processed_jobs p ON p.idempotency_key = e.key
		LEFT JOIN job_intents i ON i.idempotency_key = e.key`)
	if err != nil {
		return v, err
	}
	defer rows.Close()
	v.ClaimsPerKey = map[string]int{}
	completedAt := map[string]time.Time{}
	var latencies []float64
	seen := map[string]bool{}
	example := func(format string, args ...any) {
		if len(v.Examples) < 8 {
			v.Examples = append(v.Examples, fmt.Sprintf(format, args...))
		}
	}
	var checkouts []checkoutRow
	for rows.Next() {
		var key, kind, ref, status, named, orderRow, emailID string
		var attempts int
		var done, created *time.Time
		if err := rows.Scan(&key, &kind, &ref, &status, &attempts, &named, &orderRow, &emailID, &done, &created); err != nil {
			return v, err
		}
		v.Expected++
		seen[kind+"/"+ref] = true
		eff := charges[ref]
		switch kind {
		case "debit":
			eff = entries[ref]
		case "checkout":
			// Its effects are judged after the loop, by judgeCheckout.
			checkouts = append(checkouts, checkoutRow{key: key, orderID: ref, status: status, chargeID: named, orderRow: orderRow, emailID: emailID})
			eff = effects{}
		}
		if eff.count > 1 {
			if kind == "charge" {
				v.DupCharges += eff.count - 1
			} else {
				v.DupEntries += eff.count - 1
			}
			example("%s: %d effects %v", key, eff.count, eff.ids)
		}
		switch status {
		case "":
			v.Lost++
			example("%s: lost (no ledger row)", key)
			continue
		case "completed":
			v.Completed++
		default:
			v.Stuck++
			example("%s: stuck %s", key, status)
			continue
		}
		v.ClaimsPerKey[strconv.Itoa(attempts)]++
		completedAt[key] = *done
		if created != nil {
			latencies = append(latencies, done.Sub(*created).Seconds())
		}
		switch {
		case kind == "checkout":
		case eff.count == 0:
			v.MissingEffect++
			example("%s: completed (result %q) but no effect exists", key, named)
		case eff.count == 1 && eff.ids[0] != named:
			v.WrongResult++
			example("%s: result names %q, the effect is %q", key, named, eff.ids[0])
		case eff.count > 1 && kind == "charge" && named != eff.ids[len(eff.ids)-1]:
			v.OlderResult++
			example("%s: result names %q, not the newest charge of %v", key, named, eff.ids)
		}
	}
	if err := rows.Err(); err != nil {
		return v, err
	}
	for ref, e := range charges {
		if !seen["charge/"+ref] && !seen["checkout/"+ref] {
			v.StrayEffects += e.count
		}
	}
	if err := c.checkCheckouts(ctx, &v, checkouts, seen); err != nil {
		return v, err
	}
	for ref, e := range entries {
		if !seen["debit/"+ref] {
			v.StrayEffects += e.count
		}
	}
	v.DuplicateEffects = v.DupCharges + v.DupEntries
	if err := c.pool.QueryRow(ctx, `SELECT count(*) FROM processed_jobs WHERE idempotency_key NOT IN (SELECT key FROM faults_expected)
		AND idempotency_key NOT LIKE 'cron:%'`).Scan(&v.StrayLedgerRows); err != nil {
		return v, err
	}
	if err := c.pool.QueryRow(ctx, `SELECT count(*), coalesce(sum(n - 1), 0) FROM
		(SELECT count(*) n FROM fakepay_requests WHERE idempotency_key IS NOT NULL GROUP BY idempotency_key HAVING count(*) > 1) x`).Scan(&v.KeyReuses, &v.ReusedRequests); err != nil {
		return v, err
	}
	if err := c.lateRequests(ctx, &v, example); err != nil {
		return v, err
	}
	v.LatencyP50, v.LatencyP99 = quantile(latencies, 0.5), quantile(latencies, 0.99)

	var rec []float64
	c.hist.mu.Lock()
	for _, h := range c.hist.held {
		for _, k := range h.keys {
			if t, ok := completedAt[k]; ok {
				rec = append(rec, t.Sub(h.at).Seconds())
			}
		}
	}
	c.hist.mu.Unlock()
	v.RecoveryN = len(rec)
	v.RecoveryP50, v.RecoveryP95, v.RecoveryMax = quantile(rec, 0.5), quantile(rec, 0.95), quantile(rec, 1)

	left, bad, problems, err := c.asynqState(ctx)
	if err != nil {
		return v, err
	}
	v.Leftover, v.BadArchived, v.BadProblems = left, bad, problems
	return v, nil
}

// checkoutRow is an expected checkout as the checker reads it: its key, order, ledger
// status, and what its stored result names (empty unless completed).
type checkoutRow struct {
	key, orderID, status        string
	chargeID, orderRow, emailID string
}

// orderRow is a row of orders; emailRow a request the email endpoint stored (fence nil
// when it carried none); stepRow a step recorded for a key's current generation.
type (
	orderRow struct{ id, fence int64 }
	emailRow struct {
		id    int64
		fence *int64
		key   string
	}
	stepRow struct{ fence int64 }
)

// checkoutVerdict is judgeCheckout's finding for one checkout.
type checkoutVerdict struct {
	excused                         int // receipt emails sent again, each by a claim that did not record its step
	dupCharges, dupOrders, dupEmail int // effects beyond one: charges, order rows, emails not so attributed
	problems                        []string
}

// checkCheckouts judges every expected checkout (judgeCheckout) from fakepay_charges
// (by the charge step key), orders, fakepay_emails and processed_job_steps (the steps of
// each key's current generation), and counts the orders and emails of no expected
// checkout as stray effects.
func (c *cluster) checkCheckouts(ctx context.Context, v *verdict, checkouts []checkoutRow, seen map[string]bool) error {
	byKey, err := c.effects(ctx, `SELECT idempotency_key, id FROM fakepay_charges WHERE idempotency_key LIKE 'checkout:%' ORDER BY created_at, id`)
	if err != nil {
		return err
	}
	byOrder, err := c.effects(ctx, `SELECT order_id, id FROM fakepay_charges WHERE order_id LIKE 'co-%' ORDER BY created_at, id`)
	if err != nil {
		return err
	}
	orders := map[string][]orderRow{}
	rows, err := c.pool.Query(ctx, `SELECT order_id, id, coalesce(fence, 0) FROM orders ORDER BY id`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var id string
		var o orderRow
		if err := rows.Scan(&id, &o.id, &o.fence); err != nil {
			rows.Close()
			return err
		}
		orders[id] = append(orders[id], o)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	emails := map[string][]emailRow{}
	rows, err = c.pool.Query(ctx, `SELECT order_id, id, fence, coalesce(idempotency_key, '') FROM fakepay_emails ORDER BY id`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var id string
		var e emailRow
		if err := rows.Scan(&id, &e.id, &e.fence, &e.key); err != nil {
			rows.Close()
			return err
		}
		emails[id] = append(emails[id], e)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	steps := map[string]map[string]stepRow{}
	rows, err = c.pool.Query(ctx, `SELECT s.idempotency_key, s.step, s.fence FROM processed_job_steps s
		JOIN processed_jobs p ON p.idempotency_key = s.idempotency_key AND p.generation = s.generation`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var key, step string
		var r stepRow
		if err := rows.Scan(&key, &step, &r.fence); err != nil {
			rows.Close()
			return err
		}
		if steps[key] == nil {
			steps[key] = map[string]stepRow{}
		}
		steps[key][step] = r
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}

	v.Checkouts = len(checkouts)
	for _, co := range checkouts {
		chargeKey, _ := idempotency.StepKey(co.key, "charge")
		charged := byKey[chargeKey]
		v.CheckoutCharges += charged.count
		v.CheckoutOrders += len(orders[co.orderID])
		v.CheckoutEmails += len(emails[co.orderID])
		cv := judgeCheckout(co, charged.ids, byOrder[co.orderID].count, orders[co.orderID], emails[co.orderID], steps[co.key])
		v.ExcusedEmails += cv.excused
		v.DupCheckoutCharges += cv.dupCharges
		v.DupOrders += cv.dupOrders
		v.DupEmails += cv.dupEmail
		if len(cv.problems) > 0 {
			v.CheckoutProblems++
			for _, p := range cv.problems {
				if len(v.CheckoutFailures) < 20 {
					v.CheckoutFailures = append(v.CheckoutFailures, p)
				}
			}
		}
	}
	for id, rs := range orders {
		if !seen["checkout/"+id] {
			v.StrayEffects += len(rs)
		}
	}
	for id, es := range emails {
		if !seen["checkout/"+id] {
			v.StrayEffects += len(es)
		}
	}
	return nil
}

// judgeCheckout applies the checkout rule to one checkout, given the provider's charges
// under its charge step key (ids, oldest first) and of its order under any key, its rows
// in orders, the emails of its order, and the steps recorded for its key:
//
//   - at most one charge, under the step key, and exactly one once completed; no charge
//     of the order under another key;
//   - at most one order row, and exactly one once completed; a row only with its record
//     step, under the step's fence (StepTx commits the two together);
//   - the receipt: once its step is recorded, under fence F, exactly one email under F;
//     every other email of the order carries a fence lower than F, at most one per fence:
//     each was sent by an earlier claim that did not record the step (killed, frozen past
//     its lease, self-fenced), which the provider, honouring no key, cannot tell apart.
//     Without a record (a checkout not completed) every email carries a fence of its
//     own. Every email carries the receipt's step key. The emails beyond one that this
//     attributes are excused, and counted;
//   - a completed checkout has all three steps recorded, and its result names the charge,
//     the order row and the email under F.
func judgeCheckout(co checkoutRow, charges []string, orderCharges int, orders []orderRow, emails []emailRow, steps map[string]stepRow) checkoutVerdict {
	var cv checkoutVerdict
	problem := func(format string, args ...any) {
		cv.problems = append(cv.problems, fmt.Sprintf("checkout %s: ", co.orderID)+fmt.Sprintf(format, args...))
	}
	completed := co.status == "completed"
	chargeKey, _ := idempotency.StepKey(co.key, "charge")
	receiptKey, _ := idempotency.StepKey(co.key, "receipt")

	switch {
	case len(charges) > 1:
		cv.dupCharges = len(charges) - 1
		problem("%d charges under its step key %s: %v", len(charges), chargeKey, charges)
	case len(charges) == 0 && completed:
		problem("completed, but no charge under its step key %s", chargeKey)
	case len(charges) == 1 && completed && co.chargeID != charges[0]:
		problem("its result names charge %q, the one under its step key is %q", co.chargeID, charges[0])
	}
	if orderCharges != len(charges) {
		problem("%d charges of the order, %d of them under its step key %s", orderCharges, len(charges), chargeKey)
	}

	record, recorded := steps["record"]
	fences := make([]int64, len(orders))
	for i, o := range orders {
		fences[i] = o.fence
	}
	switch {
	case len(orders) > 1:
		cv.dupOrders = len(orders) - 1
		problem("%d order rows, under fences %v", len(orders), fences)
	case len(orders) == 0 && (completed || recorded):
		problem("no order row (record step recorded: %t)", recorded)
	case len(orders) == 1 && !recorded:
		problem("an order row under fence %d, but no record step", orders[0].fence)
	case len(orders) == 1 && orders[0].fence != record.fence:
		problem("its order row carries fence %d, its record step fence %d", orders[0].fence, record.fence)
	case len(orders) == 1 && completed && co.orderRow != strconv.FormatInt(orders[0].id, 10):
		problem("its result names order row %q, the row is %d", co.orderRow, orders[0].id)
	}

	receipt, sent := steps["receipt"]
	var atF []emailRow
	byFence := map[int64]int{}
	attributed := true
	for _, e := range emails {
		switch {
		case e.key != receiptKey:
			attributed = false
		case e.fence == nil:
			attributed = false
		case sent && *e.fence == receipt.fence:
			atF = append(atF, e)
		case sent && *e.fence > receipt.fence:
			attributed = false
		default:
			byFence[*e.fence]++
			if byFence[*e.fence] > 1 {
				attributed = false
			}
		}
	}
	if sent && len(atF) != 1 {
		attributed = false
	}
	if sent && len(atF) == 1 && completed && co.emailID != strconv.FormatInt(atF[0].id, 10) {
		problem("its result names email %q, the one under the receipt's fence %d is %d", co.emailID, receipt.fence, atF[0].id)
	}
	switch {
	case attributed:
		cv.excused = max(0, len(emails)-1)
	default:
		cv.dupEmail = max(0, len(emails)-1)
		f := "not recorded"
		if sent {
			f = "recorded under fence " + strconv.FormatInt(receipt.fence, 10)
		}
		problem("receipt step %s; %d emails under fences %s, want one under the step's fence and each other under a lower fence of its own, all with key %s",
			f, len(emails), emailFences(emails, receiptKey), receiptKey)
	}
	if completed {
		for _, s := range tasks.CheckoutSteps {
			if _, ok := steps[s]; !ok {
				problem("completed, but its step %q is not recorded", s)
			}
		}
	}
	return cv
}

// emailFences lists the emails' fences ("none" for an email that carried no fence, and
// the key when it is not want).
func emailFences(emails []emailRow, want string) string {
	parts := make([]string, len(emails))
	for i, e := range emails {
		parts[i] = "none"
		if e.fence != nil {
			parts[i] = strconv.FormatInt(*e.fence, 10)
		}
		if e.key != want {
			parts[i] += fmt.Sprintf(" (key %q)", e.key)
		}
	}
	return "[" + strings.Join(parts, " ") + "]"
}

// lateRequests counts the fenced provider requests and those that arrived late: after a
// request of a higher fence for the same key (which was sent by a claim made after this
// fence's lease ended), or after the ledger row was completed by a higher fence. The
// ledger keeps only a key's newest lease, so these bound when an older fence's lease
// ended from above; received_at is the provider's arrival time, on the same host's clock
// as the database's.
func (c *cluster) lateRequests(ctx context.Context, v *verdict, example func(string, ...any)) error {
	if err := c.pool.QueryRow(ctx, `SELECT count(*) FROM fakepay_requests WHERE fence IS NOT NULL`).Scan(&v.FencedRequests); err != nil {
		return err
	}
	rows, err := c.pool.Query(ctx, `SELECT r.idempotency_key, r.fence, r.received_at,
			(SELECT min(n.fence) FROM fakepay_requests n
				WHERE n.idempotency_key = r.idempotency_key AND n.fence > r.fence AND n.received_at < r.received_at),
			(SELECT p.fence FROM processed_jobs p
				WHERE p.idempotency_key = r.idempotency_key AND p.status = 'completed' AND p.fence > r.fence AND p.completed_at < r.received_at)
		FROM fakepay_requests r
		WHERE r.fence IS NOT NULL AND (
			EXISTS (SELECT 1 FROM fakepay_requests n
				WHERE n.idempotency_key = r.idempotency_key AND n.fence > r.fence AND n.received_at < r.received_at)
			OR EXISTS (SELECT 1 FROM processed_jobs p
				WHERE p.idempotency_key = r.idempotency_key AND p.status = 'completed' AND p.fence > r.fence AND p.completed_at < r.received_at))
		ORDER BY r.received_at`)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var key string
		var fence int64
		var at time.Time
		var newerRequest, completedBy *int64
		if err := rows.Scan(&key, &fence, &at, &newerRequest, &completedBy); err != nil {
			return err
		}
		v.LateRequests++
		switch {
		case newerRequest != nil:
			example("%s: request of fence %d received at %s, after one of fence %d", key, fence, at.Format(time.RFC3339Nano), *newerRequest)
		default:
			example("%s: request of fence %d received at %s, after fence %d completed the key", key, fence, at.Format(time.RFC3339Nano), *completedBy)
		}
	}
	return rows.Err()
}

func (c *cluster) effects(ctx context.Context, query string) (map[string]effects, error) {
	rows, err := c.pool.Query(ctx, query)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]effects{}
	for rows.Next() {
		var ref, id string
		if err := rows.Scan(&ref, &id); err != nil {
			return nil, err
		}
		e := out[ref]
		e.count++
		e.ids = append(e.ids, id)
		out[ref] = e
	}
	return out, rows.Err()
}

// asynqState reads every task hash of the queue straight from Redis (so a task hash no
// list or set points at, an orphan, is seen too): each must be completed, or archived
// when it is a deliberate bad payload, archived with a "bad payload" reason.
func (c *cluster) asynqState(ctx context.Context) (leftover []string, badArchived int, problems []string, err error) {
	prefix := "asynq:{" + tasks.Queue + "}:t:"
	iter := c.rdb.Scan(ctx, 0, prefix+"*", 500).Iterator()
	for iter.Next(ctx) {
		id := strings.TrimPrefix(iter.Val(), prefix)
		fields, err := c.rdb.HGetAll(ctx, iter.Val()).Result()
		if err != nil {
			return nil, 0, nil, fmt.Errorf("read task %s: %w", id, err)
		}
		state := fields["state"]
		_, isBad := badPayloads[id]
		switch {
		case len(fields) == 0: // gone since the scan
		case fields["msg"] == "":
			// Not a task: a hash without a message, which asynq can never run or expire.
			// Seen after Redis lost its data, when a delivery still running wrote its
			// result with asynq's ResultWriter (an HSET) before a1a0150.
			var names []string
			for k := range fields {
				names = append(names, k)
			}
			sort.Strings(names)
			c.hist.add(func(h *history) { h.resultOnly[id] = strings.Join(names, ",") })
		case state == "completed" && !isBad:
		case state == "archived" && isBad:
		default:
			leftover = append(leftover, id+" "+state)
		}
	}
	if err := iter.Err(); err != nil {
		return nil, 0, nil, err
	}
	sort.Strings(leftover)
	for id := range badPayloads {
		info, err := c.insp.GetTaskInfo(tasks.Queue, id)
		if err != nil {
			problems = append(problems, fmt.Sprintf("%s: %v", id, err))
			continue
		}
		// The worker archives a bad payload at its first delivery; a delivery cut short by
		// a worker killing itself at a fault point (another task's) is retried by asynq's
		// recovery, not by the worker: one retry per such death since they were enqueued.
		crashes := c.hist.countSince("fault_point_crash", c.badEnqueued)
		if info.State.String() != "archived" || !strings.Contains(info.LastErr, "bad payload") || info.Retried > crashes {
			problems = append(problems, fmt.Sprintf("%s: %s after %d retries (%d workers killed themselves meanwhile): %q", id, info.State, info.Retried, crashes, info.LastErr))
			continue
		}
		badArchived++
	}
	return leftover, badArchived, problems, nil
}

// settled reports whether the run is over: every expected key and every periodic job
// completed, and no task still due in asynq.
func (c *cluster) settled(ctx context.Context) (pending int, leftover int, err error) {
	if err := c.pool.QueryRow(ctx, `SELECT count(*) FROM faults_expected e LEFT JOIN processed_jobs p ON p.idempotency_key = e.key
		WHERE p.status IS DISTINCT FROM 'completed'`).Scan(&pending); err != nil {
		return 0, 0, err
	}
	cron, err := c.cronPending(ctx)
	if err != nil {
		return 0, 0, err
	}
	pending += cron
	left, _, _, err := c.asynqState(ctx)
	return pending, len(left), err
}

func quantile(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	i := int(q*float64(len(s))+0.5) - 1
	i = max(0, min(i, len(s)-1))
	return float64(int(s[i]*100+0.5)) / 100
}

func jsonString(v any) string {
	b, _ := json.MarshalIndent(v, "", "  ")
	return string(b)
}
