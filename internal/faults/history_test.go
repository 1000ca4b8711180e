//go:build faults

package faults

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"
)

// history is what the suite did and when: nemesis events, the keys a killed or stopped
// worker held, nudges. The checker reads it together with the database.
type history struct {
	mu        sync.Mutex
	start     time.Time
	events    []event
	held      []heldKeys
	stopDups  int // duplicates sent for keys a stopped worker held
	nudges    int // duplicates sent after the heal for in-progress keys whose lease ended
	dups      int // workload duplicates sent straight to asynq
	dupErrors int // workload duplicates that could not be sent (Redis down throughout)
	// resultOnly are asynq task hashes without a message (id → field names).
	resultOnly map[string]string
	lost       []lostTasks // per reboot: the tasks Redis lost, and when they were back
	promotions []promotion
}

// promotion is one Postgres failover: how long after the primary's SIGKILL the standby
// was promoted, and a write through the multi-host URL first committed (-1: not within 30 s).
type promotion struct {
	promoted, writable time.Duration
}

// lostTasks are the accepted keys whose tasks one reboot lost, and how long after Redis
// answered again they were all back in Redis (-1: not within two minutes).
type lostTasks struct {
	n    int
	back time.Duration
}

type event struct {
	At     float64 `json:"at_s"`
	Kind   string  `json:"kind"`
	Target string  `json:"target,omitempty"`
	Note   string  `json:"note,omitempty"`
}

// heldKeys are the leased keys (charges, checkouts) a process held in progress when it was
// killed or stopped.
type heldKeys struct {
	at   time.Time
	keys []string
}

func newHistory() *history { return &history{start: time.Now(), resultOnly: map[string]string{}} }

func (h *history) nemesis(kind, target string) {
	h.note(kind, target, "")
}

func (h *history) note(kind, target, note string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.events = append(h.events, event{At: time.Since(h.start).Seconds(), Kind: kind, Target: target, Note: note})
}

// countSince counts the events of kind recorded at or after t.
func (h *history) countSince(kind string, t time.Time) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, e := range h.events {
		if e.Kind == kind && e.At >= t.Sub(h.start).Seconds() {
			n++
		}
	}
	return n
}

func (h *history) byKind() map[string]int {
	h.mu.Lock()
	defer h.mu.Unlock()
	m := map[string]int{}
	for _, e := range h.events {
		m[e.Kind]++
	}
	return m
}

func (h *history) add(f func(h *history)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	f(h)
}

type leaseRow struct {
	fence int64
	until time.Time
}

// inProgressLeased reads the keys of leased jobs (charges and checkouts) in progress with
// their fence and lease end.
func (c *cluster) inProgressLeased(ctx context.Context) (map[string]leaseRow, error) {
	rows, err := c.pool.Query(ctx, `SELECT idempotency_key, fence, locked_until FROM processed_jobs
		WHERE status = 'in_progress' AND task_type IN ('payment:charge', 'order:checkout')`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]leaseRow{}
	for rows.Next() {
		var k string
		var r leaseRow
		if err := rows.Scan(&k, &r.fence, &r.until); err != nil {
			return nil, err
		}
		out[k] = r
	}
	return out, rows.Err()
}

// heldBy returns the leased keys in progress at t0 (snapshot) that nobody heartbeated
// since: still in progress under the same fence and lease end after more than one
// heartbeat interval (lease/3). Those belong to a process that is dead or stopped.
func (c *cluster) heldBy(ctx context.Context, snap map[string]leaseRow) []string {
	time.Sleep(lease/3 + 1300*time.Millisecond)
	now, err := c.inProgressLeased(ctx)
	if err != nil {
		return nil
	}
	var keys []string
	for k, r := range snap {
		if n, ok := now[k]; ok && n.fence == r.fence && n.until.Equal(r.until) {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	return keys
}

// trackHeld records the keys a process killed at t0 held, for the recovery times.
func (c *cluster) trackHeld(t0 time.Time) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	snap, err := c.inProgressLeased(ctx)
	if err != nil || len(snap) == 0 {
		return
	}
	if keys := c.heldBy(ctx, snap); len(keys) > 0 {
		c.hist.add(func(h *history) { h.held = append(h.held, heldKeys{at: t0, keys: keys}) })
	}
}

func fmtKeys(keys []string) string {
	if len(keys) > 4 {
		return fmt.Sprintf("%v… (%d)", keys[:4], len(keys))
	}
	return fmt.Sprint(keys)
}
