//go:build faults

package faults

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/idemq/idemq/idempotency/schedule"
)

// The schedulers' entry (scheduleFile): its name, its period, and the margins cut off the
// schedulers' lifetime before the ticks the checker requires (their first Sync and round
// after start; a round in flight at the stop).
const (
	tickEntry       = "settle-2s"
	tickPeriod      = 2 * time.Second
	tickStartMargin = 3 * time.Second
	tickStopMargin  = 3 * time.Second
)

// tickVerdict is what checkTicks found of the periodic jobs: the ticks the run requires,
// the intents and settlements recorded, and the breaches, each naming its key or tick.
type tickVerdict struct {
	From        string   `json:"first_tick"`
	To          string   `json:"last_tick"`
	Expected    int      `json:"ticks_expected"`
	Enqueued    int      `json:"ticks_enqueued"` // cron intents
	Completed   int      `json:"ticks_completed"`
	Settlements int      `json:"settlements"`
	Missing     int      `json:"ticks_missing"`    // required ticks without an intent, a completed job or a settlement
	Duplicated  int      `json:"ticks_duplicated"` // keys with more than one settlement row
	NotTick     int      `json:"keys_not_a_tick"`  // intents, ledger rows or settlements keyed by an instant that is no tick
	Unsettled   int      `json:"jobs_unsettled"`   // intents not completed with exactly one settlement
	Breaches    []string `json:"breaches,omitempty"`
}

// checkTicks checks the rule of the periodic jobs: every tick of the entry from the first
// after the schedulers started (plus a margin) to the last before they were stopped
// (minus a margin) has exactly one intent, one completed ledger row and one settlement
// row with its key; every key recorded is a tick (a multiple of the period), and every
// tick enqueued, inside the window or not, completed with exactly one settlement.
func (c *cluster) checkTicks(ctx context.Context) (tickVerdict, error) {
	var v tickVerdict
	first := c.schedFrom.Add(tickStartMargin).Truncate(tickPeriod).Add(tickPeriod)
	last := c.schedTo.Add(-tickStopMargin).Truncate(tickPeriod)
	v.From, v.To = first.UTC().Format(schedule.TickLayout), last.UTC().Format(schedule.TickLayout)
	intents, err := c.keyCounts(ctx, `SELECT idempotency_key, 1 FROM job_intents WHERE idempotency_key LIKE 'cron:%'`)
	if err != nil {
		return v, err
	}
	ledger, err := c.keyCounts(ctx, `SELECT idempotency_key, (status = 'completed')::int FROM processed_jobs WHERE idempotency_key LIKE 'cron:%'`)
	if err != nil {
		return v, err
	}
	settled, err := c.keyCounts(ctx, `SELECT settlement_key, count(*) FROM wallet_settlements GROUP BY settlement_key`)
	if err != nil {
		return v, err
	}
	breach := func(format string, args ...any) {
		if len(v.Breaches) < 20 {
			v.Breaches = append(v.Breaches, fmt.Sprintf(format, args...))
		}
	}
	v.Enqueued = len(intents)
	keys := map[string]bool{}
	for _, m := range []map[string]int{intents, ledger, settled} {
		for k := range m {
			keys[k] = true
		}
	}
	sorted := make([]string, 0, len(keys))
	for k := range keys {
		sorted = append(sorted, k)
	}
	sort.Strings(sorted)
	for _, k := range sorted {
		v.Settlements += settled[k]
		if ledger[k] == 1 {
			v.Completed++
		}
		at, err := time.Parse(schedule.TickLayout, strings.TrimPrefix(k, "cron:"+tickEntry+":"))
		if !strings.HasPrefix(k, "cron:"+tickEntry+":") || err != nil || !at.Equal(at.Truncate(tickPeriod)) {
			v.NotTick++
			breach("%s: not a tick of %s (intent %d, settlements %d)", k, tickEntry, intents[k], settled[k])
			continue
		}
		if settled[k] > 1 {
			v.Duplicated++
			breach("%s: %d settlement rows", k, settled[k])
		}
		if intents[k] != 1 || ledger[k] != 1 || settled[k] != 1 {
			v.Unsettled++
			if at.Before(first) || at.After(last) {
				breach("%s: intent %d, completed %d, settlements %d", k, intents[k], ledger[k], settled[k])
			}
		}
	}
	for t := first; !t.After(last); t = t.Add(tickPeriod) {
		v.Expected++
		k := schedule.Tick{Entry: tickEntry, At: t}.Key()
		if intents[k] != 1 || ledger[k] != 1 || settled[k] != 1 {
			v.Missing++
			breach("tick %s: intent %d, completed %d, settlements %d; want 1 each", t.UTC().Format(schedule.TickLayout), intents[k], ledger[k], settled[k])
		}
	}
	return v, nil
}

// pass reports whether the ticks keep the rule.
func (v tickVerdict) pass() bool {
	return v.Missing == 0 && v.Duplicated == 0 && v.NotTick == 0 && v.Unsettled == 0 && v.Expected > 0
}

// keyCounts runs a query of (key, n) rows into a map, summing n by key.
func (c *cluster) keyCounts(ctx context.Context, query string) (map[string]int, error) {
	rows, err := c.pool.Query(ctx, query)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var k string
		var n int
		if err := rows.Scan(&k, &n); err != nil {
			return nil, err
		}
		out[k] += n
	}
	return out, rows.Err()
}

// cronPending counts the periodic jobs enqueued and not completed yet.
func (c *cluster) cronPending(ctx context.Context) (int, error) {
	var n int
	err := c.pool.QueryRow(ctx, `SELECT count(*) FROM job_intents i LEFT JOIN processed_jobs p ON p.idempotency_key = i.idempotency_key
		WHERE i.idempotency_key LIKE 'cron:%' AND p.status IS DISTINCT FROM 'completed'`).Scan(&n)
	return n, err
}
