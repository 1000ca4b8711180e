package schedule

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/robfig/cron/v3"

	"github.com/idemq/idemq/idempotency"
)

// CatchUp is what an entry does, when a replica starts, with the ticks that fell while
// no replica was running: they are looked for within the entry's CatchUpWindow.
type CatchUp string

// The catch-up policies.
const (
	CatchUpAll    CatchUp = "all"    // every missed tick in the window, oldest first
	CatchUpLatest CatchUp = "latest" // only the newest missed tick
	CatchUpNone   CatchUp = "none"   // none: missed ticks are gone
)

// Overlap is what an entry does with a tick while the job of its previous tick is
// unfinished (its outbox intent is pending or published).
type Overlap string

// The overlap policies.
const (
	OverlapAllow Overlap = "allow" // enqueue the tick all the same
	OverlapSkip  Overlap = "skip"  // skip it (counted as skipped)
)

// Defaults and limits of an entry.
const (
	// DefaultCatchUp is an entry's catch-up policy when it names none.
	DefaultCatchUp = CatchUpAll
	// DefaultCatchUpWindow is an entry's catch-up window when it names none.
	DefaultCatchUpWindow = time.Hour
	// DefaultOverlap is an entry's overlap policy when it names none.
	DefaultOverlap = OverlapAllow
	// MaxName is the longest entry name, in bytes.
	MaxName = 64
	// MaxManualID is the longest id of a manual run, in bytes.
	MaxManualID = 64
	// MaxMaxRetry is the largest MaxRetry (the outbox stores it as a 32-bit integer).
	MaxMaxRetry = math.MaxInt32
	// TickLayout formats a tick in its job's key: UTC, to the second.
	TickLayout = "2006-01-02T15:04:05Z"
)

// Entry is one periodic job: on each tick of Schedule, one job of TaskType with Payload,
// keyed TickKey(Name, tick), whoever notices the tick and however many notice it.
type Entry struct {
	// Name identifies the entry: [a-z0-9_-]{1,64}.
	Name string `json:"name"`
	// Schedule is a cron expression (five fields, or a descriptor such as @hourly), read
	// in TimeZone; or "@every D", which ticks at the multiples of D (whole seconds, at
	// least 1s) since the Unix epoch, so that every replica names the same ticks.
	Schedule string `json:"schedule"`
	// TimeZone is the IANA zone a cron expression is read in; empty is UTC. Across a
	// daylight-saving change the cron library's rules apply: a local time that does not
	// exist is skipped, and a local hour that repeats is two instants, two ticks, two jobs.
	TimeZone string `json:"time_zone,omitempty"`
	// TaskType is the asynq task type of the jobs.
	TaskType string `json:"task_type"`
	// Payload is every job's payload (JSON); empty is {}. It is stored in the schedule
	// table as jsonb, so the jobs carry it compact, its keys in jsonb's order.
	Payload json.RawMessage `json:"payload,omitempty"`
	// Queue is the asynq queue; empty is outbox.DefaultQueue.
	Queue string `json:"queue,omitempty"`
	// MaxRetry is how often asynq retries a failed delivery. 0 is none, as for
	// outbox.Spec: a delivery that finds Postgres out of reach is then archived and its
	// tick never done, so give a periodic job some (the example's schedule uses 5).
	MaxRetry int `json:"max_retry,omitempty"`
	// Timeout bounds one delivery; 0 is asynq's default.
	Timeout time.Duration `json:"timeout,omitempty"`
	// CatchUp is the policy for ticks missed while no replica ran; empty is
	// DefaultCatchUp.
	CatchUp CatchUp `json:"catch_up,omitempty"`
	// CatchUpWindow is how far back a starting replica looks for missed ticks; 0 is
	// DefaultCatchUpWindow. It must be shorter than the ledger's retention, which is what
	// lets a tick already enqueued be found again.
	CatchUpWindow time.Duration `json:"catch_up_window,omitempty"`
	// Overlap is the policy for a tick whose previous tick's job is unfinished; empty is
	// DefaultOverlap.
	Overlap Overlap `json:"overlap,omitempty"`
}

// ErrInvalidEntry is wrapped by every *EntryError.
var ErrInvalidEntry = errors.New("schedule: invalid entry")

// EntryError says which entry and which of its fields is invalid. It wraps
// ErrInvalidEntry and the cause.
type EntryError struct {
	Entry string // the entry's name, or its position (#3) when it has no valid name
	Field string // the field, by its name in a schedule file
	Err   error
}

func (e *EntryError) Error() string {
	return fmt.Sprintf("schedule: entry %s: %s: %v", e.Entry, e.Field, e.Err)
}

// Unwrap returns ErrInvalidEntry and the cause.
func (e *EntryError) Unwrap() []error { return []error{ErrInvalidEntry, e.Err} }

// TickKey is the key of entry name's job for tick: cron:<name>:<tick in UTC, TickLayout>.
func TickKey(name string, tick time.Time) string {
	return "cron:" + name + ":" + tick.UTC().Format(TickLayout)
}

// ManualKey is the key of a manual run of entry name: cron:<name>:manual:<id>.
func ManualKey(name, id string) string {
	return "cron:" + name + ":manual:" + id
}

// Tick is what a periodic job's payload says of its tick, beside the entry's payload:
// the fields schedule_entry, tick (RFC 3339, UTC) and, for a manual run, manual_run. Embed
// it in the job's payload type and the type is an idempotency.Job keyed as the scheduler
// keys it (Key), its lock scope the key:
//
//	type Settle struct {
//		schedule.Tick
//		Period string `json:"period"`
//	}
type Tick struct {
	Entry  string    `json:"schedule_entry"`
	At     time.Time `json:"tick"`
	Manual string    `json:"manual_run,omitempty"`
}

// Key is TickKey(Entry, At), or ManualKey(Entry, Manual) for a manual run.
func (t Tick) Key() string {
	if t.Manual != "" {
		return ManualKey(t.Entry, t.Manual)
	}
	return TickKey(t.Entry, t.At)
}

// LockScope is "": the key.
func (t Tick) LockScope() string { return "" }

// tickFields are the payload fields a Tick adds; an entry's payload may not use them.
var tickFields = []string{"schedule_entry", "tick", "manual_run"}

// payload is an entry's payload (a JSON object, compact) with t's fields added.
func (t Tick) payload(entry json.RawMessage) []byte {
	b, _ := json.Marshal(t) // a struct of strings and a time: cannot fail
	if len(entry) <= 2 {    // {}
		return b
	}
	return append(append(b[:len(b)-1:len(b)-1], ','), entry[1:]...)
}

// next is a schedule: the first tick strictly after t.
type next interface {
	Next(t time.Time) time.Time
}

// every ticks at the multiples of d since the Unix epoch.
type every time.Duration

func (d every) Next(t time.Time) time.Time {
	n, step := t.UnixNano(), int64(d)
	q := n / step
	if n < 0 && n%step != 0 {
		q-- // floor, before the epoch
	}
	return time.Unix(0, (q+1)*step).UTC()
}

// plan is a checked entry, its defaults filled, with its schedule parsed.
type plan struct {
	Entry
	sched next
}

// compile checks e, fills its defaults and parses its schedule. Errors are *EntryError.
func compile(e Entry, label string) (*plan, error) {
	bad := func(field string, err error) (*plan, error) {
		return nil, &EntryError{Entry: label, Field: field, Err: err}
	}
	if err := checkName(e.Name); err != nil {
		return bad("name", err)
	}
	label = fmt.Sprintf("%q", e.Name)
	var sched next
	expr := strings.TrimSpace(e.Schedule)
	switch {
	case expr == "":
		return bad("schedule", errors.New("required: a cron expression or @every D"))
	case strings.HasPrefix(expr, "@every"):
		if e.TimeZone != "" {
			return bad("time_zone", errors.New("@every ticks at multiples of D since the Unix epoch: a time zone does not apply"))
		}
		d, err := time.ParseDuration(strings.TrimSpace(strings.TrimPrefix(expr, "@every")))
		if err != nil || d < time.Second || d%time.Second != 0 {
			return bad("schedule", fmt.Errorf("%q: @every takes a duration of whole seconds, at least 1s (e.g. @every 5m)", expr))
		}
		sched = every(d)
	case strings.HasPrefix(expr, "TZ=") || strings.HasPrefix(expr, "CRON_TZ="):
		return bad("schedule", fmt.Errorf("%q: give the zone in time_zone, not in the expression", expr))
	default:
		// Without a time zone the expression is read in UTC, never in the host's zone:
		// replicas on hosts in different zones must name the same instants.
		zone := "UTC"
		if e.TimeZone != "" {
			if _, err := time.LoadLocation(e.TimeZone); err != nil {
				return bad("time_zone", fmt.Errorf("%q is not an IANA time zone this system knows: %v", e.TimeZone, err))
			}
			zone = e.TimeZone
		}
		expr = "CRON_TZ=" + zone + " " + expr
		s, err := cron.ParseStandard(expr)
		if err != nil {
			return bad("schedule", fmt.Errorf("%q: %v", e.Schedule, err))
		}
		sched = s
	}
	if e.TaskType == "" {
		return bad("task_type", errors.New("required"))
	}
	if len(e.Payload) == 0 {
		e.Payload = json.RawMessage(`{}`)
	}
	var compact bytes.Buffer
	if err := json.Compact(&compact, e.Payload); err != nil {
		return bad("payload", fmt.Errorf("not valid JSON: %v", err))
	}
	e.Payload = compact.Bytes()
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(e.Payload, &fields); err != nil {
		return bad("payload", errors.New("must be a JSON object: the scheduler adds the tick's fields to it"))
	}
	for _, f := range tickFields {
		if _, ok := fields[f]; ok {
			return bad("payload", fmt.Errorf("%q is the scheduler's field (schedule.Tick): rename it", f))
		}
	}
	if err := checkNoNUL(e.Payload); err != nil {
		return bad("payload", err)
	}
	// The largest job this entry makes: a manual run with the longest id.
	longest := Tick{Entry: e.Name, At: time.Date(2006, 1, 2, 15, 4, 5, 0, time.UTC), Manual: strings.Repeat("x", MaxManualID)}
	if n := len(longest.payload(e.Payload)); n > idempotency.MaxPayloadBytes {
		return bad("payload", fmt.Errorf("%d bytes, %d with the tick's fields (schedule_entry, tick, manual_run); the limit is %d",
			len(e.Payload), n, idempotency.MaxPayloadBytes))
	}
	if e.MaxRetry < 0 || e.MaxRetry > MaxMaxRetry {
		return bad("max_retry", fmt.Errorf("%d is out of range: 0..%d", e.MaxRetry, MaxMaxRetry))
	}
	if e.Timeout < 0 {
		return bad("timeout", errors.New("must not be negative"))
	}
	switch e.CatchUp {
	case "":
		e.CatchUp = DefaultCatchUp
	case CatchUpAll, CatchUpLatest, CatchUpNone:
	default:
		return bad("catch_up", fmt.Errorf("%q: must be all, latest or none", e.CatchUp))
	}
	switch {
	case e.CatchUpWindow == 0:
		e.CatchUpWindow = DefaultCatchUpWindow
	case e.CatchUpWindow < 0:
		return bad("catch_up_window", errors.New("must not be negative"))
	}
	switch e.Overlap {
	case "":
		e.Overlap = DefaultOverlap
	case OverlapAllow, OverlapSkip:
	default:
		return bad("overlap", fmt.Errorf("%q: must be allow or skip", e.Overlap))
	}
	return &plan{Entry: e, sched: sched}, nil
}

// checkNoNUL refuses a JSON text with a NUL character (\u0000) in a key or a string:
// Postgres's jsonb, which stores an entry's payload, cannot hold one.
func checkNoNUL(payload []byte) error {
	dec := json.NewDecoder(bytes.NewReader(payload))
	for {
		tok, err := dec.Token()
		if err != nil {
			return nil // the end; the text was checked as JSON already
		}
		if str, ok := tok.(string); ok && strings.IndexByte(str, 0) >= 0 {
			return errors.New(`a NUL character (\u0000) in a key or a string: the schedule table (jsonb) cannot store it`)
		}
	}
}

func checkName(name string) error {
	ok := len(name) >= 1 && len(name) <= MaxName
	for i := 0; ok && i < len(name); i++ {
		c := name[i]
		ok = c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '-'
	}
	if !ok {
		return fmt.Errorf("%q must match [a-z0-9_-]{1,%d}", name, MaxName)
	}
	return nil
}

// Validate checks entries as New does: each entry's fields (errors name the entry and the
// field, all of them joined), and that no name is used twice.
func Validate(entries []Entry) error {
	_, err := compileAll(entries)
	return err
}

func compileAll(entries []Entry) ([]*plan, error) {
	var errs []error
	plans := make([]*plan, 0, len(entries))
	seen := make(map[string]bool, len(entries))
	for i, e := range entries {
		p, err := compile(e, fmt.Sprintf("#%d", i+1))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if seen[e.Name] {
			errs = append(errs, &EntryError{Entry: fmt.Sprintf("%q", e.Name), Field: "name", Err: errors.New("used by an earlier entry too")})
			continue
		}
		seen[e.Name] = true
		plans = append(plans, p)
	}
	return plans, errors.Join(errs...)
}

// ticks returns p's ticks in (after, upTo], oldest first, at most limit of them (the
// newest).
func (p *plan) ticks(after, upTo time.Time, limit int) []time.Time {
	var out []time.Time
	for t := p.sched.Next(after); !t.After(upTo); t = p.sched.Next(t) {
		if t.IsZero() {
			break // a cron expression with no next time (Feb 30th)
		}
		out = append(out, t.UTC())
		if len(out) > limit {
			out = out[1:]
		}
	}
	return out
}
