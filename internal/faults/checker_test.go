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
	StrayLedgerRows int            `json:"stray_ledger_rows"`
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
			coalesce(p.result->>'charge_id', p.result->>'entry_id', ''), p.completed_at, i.created_at
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
	for rows.Next() {
		var key, kind, ref, status, named string
		var attempts int
		var done, created *time.Time
		if err := rows.Scan(&key, &kind, &ref, &status, &attempts, &named, &done, &created); err != nil {
			return v, err
		}
		v.Expected++
		seen[kind+"/"+ref] = true
		eff := charges[ref]
		if kind == "debit" {
			eff = entries[ref]
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
		if !seen["charge/"+ref] {
			v.StrayEffects += e.count
		}
	}
	for ref, e := range entries {
		if !seen["debit/"+ref] {
			v.StrayEffects += e.count
		}
	}
	v.DuplicateEffects = v.DupCharges + v.DupEntries
	if err := c.pool.QueryRow(ctx, `SELECT count(*) FROM processed_jobs WHERE idempotency_key NOT IN (SELECT key FROM faults_expected)`).Scan(&v.StrayLedgerRows); err != nil {
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
		if info.State.String() != "archived" || !strings.Contains(info.LastErr, "bad payload") || info.Retried != 0 {
			problems = append(problems, fmt.Sprintf("%s: %s after %d retries: %q", id, info.State, info.Retried, info.LastErr))
			continue
		}
		badArchived++
	}
	return leftover, badArchived, problems, nil
}

// settled reports whether the run is over: every expected key completed and no task
// still due in asynq.
func (c *cluster) settled(ctx context.Context) (pending int, leftover int, err error) {
	if err := c.pool.QueryRow(ctx, `SELECT count(*) FROM faults_expected e LEFT JOIN processed_jobs p ON p.idempotency_key = e.key
		WHERE p.status IS DISTINCT FROM 'completed'`).Scan(&pending); err != nil {
		return 0, 0, err
	}
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
