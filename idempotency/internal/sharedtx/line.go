package sharedtx

import (
	"cmp"
	"context"
	"slices"
	"time"
)

// A scope's line: the deliveries of one scope (Delivery.Scope) run one unit at a time.

// line is a scope's waiting deliveries; the scope is in Exec.scopes while a unit of it
// is queued or runs.
type line struct{ waiting []*member }

// requeueRounds bounds how often a delivery runs again after a conflict: then it is busy.
const requeueRounds = 5

// scoped is Run for a delivery with a scope.
func (e *Exec) scoped(ctx context.Context, d Delivery) Outcome {
	m := newMember(ctx, d, false)
	m.scope, m.timed = d.Scope, true
	e.mu.Lock()
	if ln := e.scopes[d.Scope]; ln != nil {
		ln.waiting = append(ln.waiting, m)
		e.mu.Unlock()
		stall := time.AfterFunc(e.StallAfter, func() { e.stalled(m) })
		defer stall.Stop()
	} else {
		e.scopes[d.Scope] = &line{}
		e.mu.Unlock()
		e.startUnit(m)
	}
	o := e.await(m, func() bool { return e.leaveLine(m) })
	if !o.alone {
		return o
	}
	// The scope's turn is this delivery's, alone, on this goroutine.
	defer e.release(d.Scope)
	return e.alone(ctx, d, m.round, !e.cfg.Alone)
}

// stalled reports m, which waited Exec.StallAfter in its scope's line.
func (e *Exec) stalled(m *member) {
	e.observe(EventLineStalled, m)
	if e.cfg.Stalled != nil {
		e.cfg.Stalled(m.scope, m.d.Key, e.StallAfter)
	}
}

// startUnit starts the scope's next unit with m at its head: queued for a batch, or
// alone when deliveries do not share transactions now.
func (e *Exec) startUnit(m *member) {
	if e.cfg.Alone || e.handlers.slow(e.Slow) {
		m.answer <- Outcome{alone: true}
		return
	}
	e.push(m)
}

// leaveLine takes m, whose caller gives up, out of its line or the queue, unless a batch
// took it already (then it reports false).
func (e *Exec) leaveLine(m *member) bool {
	e.mu.Lock()
	if ln := e.scopes[m.scope]; ln != nil {
		if i := slices.Index(ln.waiting, m); i >= 0 {
			ln.waiting = slices.Delete(ln.waiting, i, i+1)
			e.mu.Unlock()
			return true
		}
	}
	e.mu.Unlock()
	if e.q.Leave(0, m) {
		e.release(m.scope) // m headed the scope's unit
		return true
	}
	return false
}

// release ends a unit of scope: the line's next delivery starts the next unit, or the
// scope is forgotten.
func (e *Exec) release(scope string) {
	e.mu.Lock()
	ln := e.scopes[scope]
	if len(ln.waiting) == 0 {
		delete(e.scopes, scope)
		e.mu.Unlock()
		return
	}
	next := ln.waiting[0]
	ln.waiting = slices.Delete(ln.waiting, 0, 1)
	e.mu.Unlock()
	e.startUnit(next)
}

// withLines adds to the batch ms the deliveries waiting in the lines of its scoped
// members, up to n members in all, one per key, and sorts it by key.
func (e *Exec) withLines(ms []*member, n int) []*member {
	// ms is the queue's batch, which Done must get back as it was (the leads' keys are
	// in flight): the batch grows and is sorted in a copy.
	if !slices.ContainsFunc(ms, func(m *member) bool { return m.scope != "" }) {
		return ms
	}
	leads := ms
	ms = slices.Clone(ms)
	keys := make(map[string]bool, len(ms))
	for _, m := range ms {
		keys[m.d.Key] = true
	}
	e.mu.Lock()
	for _, lead := range leads {
		if lead.scope == "" {
			continue
		}
		ln := e.scopes[lead.scope]
		rest := ln.waiting[:0]
		for _, f := range ln.waiting {
			if len(ms) < n && !keys[f.d.Key] {
				keys[f.d.Key] = true
				ms = append(ms, f)
			} else {
				rest = append(rest, f)
			}
		}
		clear(ln.waiting[len(rest):])
		ln.waiting = rest
	}
	e.mu.Unlock()
	if len(ms) > len(leads) {
		slices.SortFunc(ms, func(a, b *member) int { return cmp.Compare(a.d.Key, b.d.Key) })
	}
	return ms
}

// afterLines ends the units of the scopes of the batch ms that ran: the members it sent
// back go to the head of their lines, and each scope's next unit starts.
func (e *Exec) afterLines(ms []*member) {
	if !slices.ContainsFunc(ms, func(m *member) bool { return m.scope != "" }) {
		return
	}
	var scopes []string
	back := map[string][]*member{}
	for _, m := range ms {
		if m.scope == "" {
			continue
		}
		if !slices.Contains(scopes, m.scope) {
			scopes = append(scopes, m.scope)
		}
		if m.requeue {
			m.requeue, m.answered, m.finish, m.later = false, false, finish{}, false
			back[m.scope] = append(back[m.scope], m)
		}
	}
	for _, s := range scopes {
		if b := back[s]; len(b) > 0 {
			e.mu.Lock()
			ln := e.scopes[s]
			ln.waiting = append(b, ln.waiting...)
			e.mu.Unlock()
		}
		e.release(s)
	}
}
