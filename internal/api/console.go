package api

import (
	"fmt"
	"maps"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
)

// The ledger list page's filters, as query parameters. Each takes a fixed set of values
// (listed in its 400), so that every link and form of the page names a filter the same
// way.
const (
	paramStatus        = "status"
	paramType          = "type"
	paramStartedWithin = "started_within"
	paramOlderThan     = "older_than"
	paramAttention     = "attention"
	paramDuplicates    = "duplicates"
	paramLease         = "lease"
	paramWindow        = "window"
	paramLimit         = "limit"
	paramKey           = "key"
)

// age is one choice of the age filters and the counts' window.
type age struct {
	Name string
	D    time.Duration
}

var (
	// ages are the choices of started_within and older_than.
	ages = []age{{"5m", 5 * time.Minute}, {"15m", 15 * time.Minute}, {"1h", time.Hour}, {"6h", 6 * time.Hour},
		{"24h", 24 * time.Hour}, {"7d", 7 * 24 * time.Hour}, {"30d", 30 * 24 * time.Hour}}
	// windows are the choices of the counts' window; the default is the first hour.
	windows       = []age{{"5m", 5 * time.Minute}, {"1h", time.Hour}, {"24h", 24 * time.Hour}}
	defaultWindow = windows[1]
	leases        = []string{idempotency.LeaseLive, idempotency.LeaseLapsed}
	// maxTypeBytes bounds ?type=; task types are short names such as payment:charge.
	maxTypeBytes = 128
)

// listFilter is the list page's query, parsed and checked.
type listFilter struct {
	Status        string
	Type          string
	StartedWithin string // a name from ages, or ""
	OlderThan     string
	Attention     bool
	Duplicates    bool
	Lease         string
	Window        string // a name from windows
	Limit         int
	LimitSet      bool // ?limit= was given: links keep it
}

// paramError is a bad query parameter: the page answers 400 with its message.
type paramError struct{ msg string }

func (e *paramError) Error() string { return e.msg }

func badParam(name, got string, allowed ...string) error {
	return &paramError{fmt.Sprintf("%s: %q is not allowed; allowed: %s", name, got, strings.Join(allowed, ", "))}
}

func ageNames(list []age) []string {
	out := make([]string, len(list))
	for i, a := range list {
		out[i] = a.Name
	}
	return out
}

func findAge(list []age, name string) (age, bool) {
	for _, a := range list {
		if a.Name == name {
			return a, true
		}
	}
	return age{}, false
}

// parseFlag reads a checkbox: "" and "0" are off, "1" is on.
func parseFlag(q url.Values, name string) (bool, error) {
	switch v := q.Get(name); v {
	case "", "0":
		return false, nil
	case "1":
		return true, nil
	default:
		return false, badParam(name, v, `"" or 0 (off)`, "1 (on)")
	}
}

// parseListFilter checks every filter of q; an error is a *paramError naming the
// parameter and what it allows.
func parseListFilter(q url.Values) (listFilter, error) {
	f := listFilter{Status: q.Get(paramStatus), Type: strings.TrimSpace(q.Get(paramType)), Lease: q.Get(paramLease),
		StartedWithin: q.Get(paramStartedWithin), OlderThan: q.Get(paramOlderThan), Window: q.Get(paramWindow), Limit: 50}
	var err error
	if f.Status != "" && !contains(statuses, f.Status) {
		return f, badParam(paramStatus, f.Status, statuses...)
	}
	if len(f.Type) > maxTypeBytes || strings.ContainsFunc(f.Type, func(r rune) bool { return r <= ' ' || r > '~' }) {
		return f, &paramError{fmt.Sprintf("%s: a task type is at most %d bytes of printable ASCII without spaces, e.g. payment:charge", paramType, maxTypeBytes)}
	}
	for _, name := range []string{paramStartedWithin, paramOlderThan} {
		if v := q.Get(name); v != "" {
			if _, ok := findAge(ages, v); !ok {
				return f, badParam(name, v, ageNames(ages)...)
			}
		}
	}
	if f.Window == "" {
		f.Window = defaultWindow.Name
	} else if _, ok := findAge(windows, f.Window); !ok {
		return f, badParam(paramWindow, f.Window, ageNames(windows)...)
	}
	if f.Lease != "" && !contains(leases, f.Lease) {
		return f, badParam(paramLease, f.Lease, leases...)
	}
	if f.Attention, err = parseFlag(q, paramAttention); err != nil {
		return f, err
	}
	if f.Duplicates, err = parseFlag(q, paramDuplicates); err != nil {
		return f, err
	}
	if f.Attention && f.Status != "" && f.Status != idempotency.StatusNeedsAttention {
		return f, &paramError{fmt.Sprintf("%s: needs-attention rows only, but %s=%s; leave %s empty or set it to %s",
			paramAttention, paramStatus, f.Status, paramStatus, idempotency.StatusNeedsAttention)}
	}
	if f.Lease != "" && (f.Status != "" && f.Status != idempotency.StatusInProgress || f.Attention) {
		return f, &paramError{fmt.Sprintf("%s: only in_progress rows have a lease; leave %s empty or set it to %s",
			paramLease, paramStatus, idempotency.StatusInProgress)}
	}
	if v := q.Get(paramLimit); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			return f, &paramError{fmt.Sprintf("%s: %q is not allowed; allowed: a whole number from 1 (more than %d shows %d)", paramLimit, v, maxLedgerPageRows, maxLedgerPageRows)}
		}
		f.Limit, f.LimitSet = min(n, maxLedgerPageRows), true
	}
	return f, nil
}

// filter is f as the ledger's Find takes it.
func (f listFilter) filter() idempotency.Filter {
	out := idempotency.Filter{Status: f.Status, TaskType: f.Type, Lease: f.Lease, HasDuplicates: f.Duplicates, Limit: f.Limit}
	if f.Attention {
		out.Status = idempotency.StatusNeedsAttention
	}
	if a, ok := findAge(ages, f.StartedWithin); ok {
		out.StartedWithin = a.D
	}
	if a, ok := findAge(ages, f.OlderThan); ok {
		out.StartedBefore = a.D
	}
	return out
}

// Filtered reports whether any filter narrows the list.
func (f listFilter) Filtered() bool {
	return f.Status != "" || f.Type != "" || f.StartedWithin != "" || f.OlderThan != "" || f.Attention || f.Duplicates || f.Lease != ""
}

// query is f as query parameters, with only what is set, in a fixed order.
func (f listFilter) query() url.Values {
	q := url.Values{}
	set := func(name, v string) {
		if v != "" {
			q.Set(name, v)
		}
	}
	set(paramStatus, f.Status)
	set(paramType, f.Type)
	set(paramStartedWithin, f.StartedWithin)
	set(paramOlderThan, f.OlderThan)
	if f.Attention {
		q.Set(paramAttention, "1")
	}
	if f.Duplicates {
		q.Set(paramDuplicates, "1")
	}
	set(paramLease, f.Lease)
	if f.Window != defaultWindow.Name {
		set(paramWindow, f.Window)
	}
	if f.LimitSet {
		q.Set(paramLimit, strconv.Itoa(f.Limit))
	}
	return q
}

// Link is the list page under f, changed by edit.
func (f listFilter) Link(edit func(*listFilter)) string {
	if edit != nil {
		edit(&f)
	}
	if q := f.query().Encode(); q != "" {
		return "/ledger/?" + q
	}
	return "/ledger/"
}

// WindowLink is the list page under f with the counts over window.
func (f listFilter) WindowLink(window string) string {
	return f.Link(func(f *listFilter) { f.Window = window })
}

// Without is the list page under f without the named filter.
func (f listFilter) Without(name string) string {
	return f.Link(func(f *listFilter) {
		switch name {
		case paramStatus:
			f.Status = ""
		case paramType:
			f.Type = ""
		case paramStartedWithin:
			f.StartedWithin = ""
		case paramOlderThan:
			f.OlderThan = ""
		case paramAttention:
			f.Attention = false
		case paramDuplicates:
			f.Duplicates = false
		case paramLease:
			f.Lease = ""
		}
	})
}

// CountLink is the list of the rows a count of the window counts: started within it, in
// status, under lease ("" for any).
func (f listFilter) CountLink(status, lease string) string {
	return listFilter{Status: status, Lease: lease, StartedWithin: f.Window, Window: f.Window, Limit: f.Limit, LimitSet: f.LimitSet}.Link(nil)
}

// countRow is one count at the top of the list page.
type countRow struct {
	Label string
	N     int64
	Link  string // the rows it counts, "" for events
	Class string
}

// countRows are c as the page shows them: the rows by outcome, then the events by kind
// (the known kinds always, in their order, then any other kind recorded).
func countRows(f listFilter, c idempotency.Counts) (rows, events []countRow) {
	rows = []countRow{
		{"completed", c.Completed, f.CountLink(idempotency.StatusCompleted, ""), "completed"},
		{"failed", c.Failed, f.CountLink(idempotency.StatusFailed, ""), "failed"},
		{"needs attention", c.NeedsAttention, f.CountLink(idempotency.StatusNeedsAttention, ""), "needs_attention"},
		{"in progress, live", c.Live, f.CountLink(idempotency.StatusInProgress, idempotency.LeaseLive), "in_progress"},
		{"in progress, lapsed", c.Lapsed, f.CountLink(idempotency.StatusInProgress, idempotency.LeaseLapsed), "in_progress lapsed"},
	}
	seen := map[string]bool{}
	for _, k := range idempotency.HistoryKinds {
		kind := string(k)
		seen[kind] = true
		events = append(events, countRow{Label: kind, N: c.Events[kind], Class: "event"})
	}
	others := slices.Sorted(maps.Keys(c.Events))
	for _, kind := range others {
		if !seen[kind] {
			events = append(events, countRow{Label: kind, N: c.Events[kind], Class: "event"})
		}
	}
	return rows, events
}

// taskRef is one asynq task of a listed row: asynqmon's page of it.
type taskRef struct{ ID, Label, Link string }

// maxTaskLinks bounds the TaskIDs a row links: the first publish and the latest ones.
const maxTaskLinks = 4

// taskRefs are the asynqmon pages of it's tasks: the first publish (the key), then the
// latest republishes (key#r<n>), at most maxTaskLinks in all.
func taskRefs(it outbox.IntentTask) []taskRef {
	ids := it.TaskIDs()
	if len(ids) > maxTaskLinks {
		ids = append(ids[:1], ids[len(ids)-maxTaskLinks+1:]...)
	}
	out := make([]taskRef, len(ids))
	for i, id := range ids {
		label := "asynqmon"
		if i > 0 {
			label = strings.TrimPrefix(id, it.Key)
		}
		out[i] = taskRef{ID: id, Label: label, Link: taskLink(it.Queue, id)}
	}
	return out
}
