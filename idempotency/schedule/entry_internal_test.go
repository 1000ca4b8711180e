package schedule

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency"
)

func mustPlan(t *testing.T, e Entry) *plan {
	t.Helper()
	if e.TaskType == "" {
		e.TaskType = "t"
	}
	p, err := compile(e, "#1")
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func utc(s string) time.Time {
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		panic(err)
	}
	return t.UTC()
}

func fmtTicks(ts []time.Time) string {
	var b strings.Builder
	for i, t := range ts {
		if i > 0 {
			b.WriteString(" ")
		}
		b.WriteString(t.Format(TickLayout))
	}
	return b.String()
}

// @every D ticks at the multiples of D since the epoch, whatever the instant asked from:
// two replicas started at different times name the same ticks.
func TestEveryTicksAtEpochMultiples(t *testing.T) {
	p := mustPlan(t, Entry{Name: "e", Schedule: "@every 7m"})
	got := fmtTicks(p.ticks(utc("2026-12-03T10:00:00Z"), utc("2026-12-03T10:20:00Z"), 100))
	// 2026-12-03T10:00:00Z is 1,796,292,000 s after the epoch; 7 min = 420 s; the next
	// multiple is 1,796,292,120 (10:02:00).
	want := "2026-12-03T10:02:00Z 2026-12-03T10:09:00Z 2026-12-03T10:16:00Z"
	if got != want {
		t.Fatalf("ticks %s, want %s", got, want)
	}
	for _, from := range []string{"2026-12-03T10:02:00Z", "2026-12-03T10:05:31Z"} {
		if n := p.sched.Next(utc(from)); !n.Equal(utc("2026-12-03T10:09:00Z")) {
			t.Errorf("Next(%s) = %s, want 10:09:00", from, n)
		}
	}
	if got := p.ticks(utc("2026-12-03T10:00:00Z"), utc("2026-12-03T12:00:00Z"), 2); fmtTicks(got) != "2026-12-03T11:47:00Z 2026-12-03T11:54:00Z" {
		t.Errorf("limited ticks %s, want the newest two", fmtTicks(got))
	}
}

// Across daylight-saving changes in a named zone the cron library's rules apply: a local
// time that does not exist (spring forward) has no tick that day, and a local time that
// repeats (fall back) is two instants, two ticks.
func TestCronAcrossDaylightSaving(t *testing.T) {
	p := mustPlan(t, Entry{Name: "dst", Schedule: "30 2 * * *", TimeZone: "Europe/Berlin"})
	// 2026-03-29: 02:00 CET jumps to 03:00 CEST; 02:30 does not exist that day.
	spring := fmtTicks(p.ticks(utc("2026-03-27T12:00:00Z"), utc("2026-03-31T12:00:00Z"), 100))
	if want := "2026-03-28T01:30:00Z 2026-03-30T00:30:00Z 2026-03-31T00:30:00Z"; spring != want {
		t.Errorf("spring forward: %s, want %s", spring, want)
	}
	// 2026-10-25: 03:00 CEST falls back to 02:00 CET; 02:30 is 00:30Z, then 01:30Z.
	fall := fmtTicks(p.ticks(utc("2026-10-23T12:00:00Z"), utc("2026-10-26T12:00:00Z"), 100))
	if want := "2026-10-24T00:30:00Z 2026-10-25T00:30:00Z 2026-10-25T01:30:00Z 2026-10-26T01:30:00Z"; fall != want {
		t.Errorf("fall back: %s, want %s (two instants for the repeated 02:30)", fall, want)
	}
	keys := map[string]bool{}
	for _, tick := range p.ticks(utc("2026-10-24T12:00:00Z"), utc("2026-10-25T12:00:00Z"), 100) {
		keys[TickKey("dst", tick)] = true
	}
	if !keys["cron:dst:2026-10-25T00:30:00Z"] || !keys["cron:dst:2026-10-25T01:30:00Z"] {
		t.Errorf("the repeated hour's jobs: %v, want two keys", keys)
	}
}

func TestEntryErrorsNameTheField(t *testing.T) {
	for i, c := range []struct {
		e     Entry
		field string
	}{
		{Entry{Name: "Bad Name", Schedule: "@every 1m", TaskType: "t"}, "name"},
		{Entry{Name: "a", Schedule: "", TaskType: "t"}, "schedule"},
		{Entry{Name: "a", Schedule: "61 * * * *", TaskType: "t"}, "schedule"},
		{Entry{Name: "a", Schedule: "@every 1500ms", TaskType: "t"}, "schedule"},
		{Entry{Name: "a", Schedule: "@every 1m", TimeZone: "Europe/Berlin", TaskType: "t"}, "time_zone"},
		{Entry{Name: "a", Schedule: "0 * * * *", TimeZone: "Mars/Olympus", TaskType: "t"}, "time_zone"},
		{Entry{Name: "a", Schedule: "CRON_TZ=UTC 0 * * * *", TaskType: "t"}, "schedule"},
		{Entry{Name: "a", Schedule: "@hourly"}, "task_type"},
		{Entry{Name: "a", Schedule: "@hourly", TaskType: "t", Payload: []byte("{")}, "payload"},
		{Entry{Name: "a", Schedule: "@hourly", TaskType: "t", Payload: []byte("[1]")}, "payload"},
		{Entry{Name: "a", Schedule: "@hourly", TaskType: "t", Payload: []byte(`{"tick":1}`)}, "payload"},
		{Entry{Name: "a", Schedule: "@hourly", TaskType: "t", CatchUp: "some"}, "catch_up"},
		{Entry{Name: "a", Schedule: "@hourly", TaskType: "t", Overlap: "queue"}, "overlap"},
		{Entry{Name: "a", Schedule: "@hourly", TaskType: "t", CatchUpWindow: -time.Second}, "catch_up_window"},
		// What every tick would refuse is refused at the start.
		{Entry{Name: "a", Schedule: "@hourly", TaskType: "t", Payload: []byte(`{"note":"a\u0000b"}`)}, "payload"},
		{Entry{Name: "a", Schedule: "@hourly", TaskType: "t", Payload: []byte(`{"a\u0000":1}`)}, "payload"},
		{Entry{Name: "a", Schedule: "@hourly", TaskType: "t", Payload: []byte(`{"pad":"` + strings.Repeat("x", idempotency.MaxPayloadBytes-20) + `"}`)}, "payload"},
		{Entry{Name: "a", Schedule: "@hourly", TaskType: "t", MaxRetry: 1 << 32}, "max_retry"},
		{Entry{Name: "a", Schedule: "@hourly", TaskType: "t", MaxRetry: -1}, "max_retry"},
	} {
		err := Validate([]Entry{c.e})
		var ee *EntryError
		if !errors.As(err, &ee) || ee.Field != c.field || !errors.Is(err, ErrInvalidEntry) {
			t.Errorf("case %d (%s of %d bytes, max_retry %d): %.200v, want an *EntryError on %s", i, c.field, len(c.e.Payload), c.e.MaxRetry, err, c.field)
		}
	}
	err := Validate([]Entry{{Name: "a", Schedule: "@hourly", TaskType: "t"}, {Name: "a", Schedule: "@daily", TaskType: "t"}})
	if err == nil || !strings.Contains(err.Error(), `entry "a": name: used by an earlier entry too`) {
		t.Errorf("a name used twice: %v", err)
	}
}
