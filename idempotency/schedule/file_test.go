package schedule_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency/schedule"
)

func TestParseFile(t *testing.T) {
	entries, err := schedule.ParseFile([]byte(`
entries:
  - name: settle-hourly
    schedule: "0 * * * *"
    time_zone: Europe/Berlin
    task_type: wallet:settle
    payload: {period: hour, accounts: [a, b]}
    catch_up: latest
    catch_up_window: 6h
    overlap: skip
    timeout: 90s
  - name: ping
    schedule: "@every 30s"
    task_type: ping
`))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 2 {
		t.Fatalf("%d entries, want 2", len(entries))
	}
	e := entries[0]
	if e.Name != "settle-hourly" || e.TimeZone != "Europe/Berlin" || e.CatchUp != schedule.CatchUpLatest ||
		e.CatchUpWindow != 6*time.Hour || e.Overlap != schedule.OverlapSkip || e.Timeout != 90*time.Second ||
		string(e.Payload) != `{"accounts":["a","b"],"period":"hour"}` {
		t.Errorf("first entry %+v (payload %s)", e, e.Payload)
	}

	for _, c := range []struct{ yaml, want string }{
		{"entries:\n  - name: a\n    schedule: '@hourly'\n    task_type: t\n    colour: red\n", "field colour not found"},
		{"entries:\n  - name: a\n    schedule: '@hourly'\n    task_type: t\n    catch_up_window: soon\n", `entry "a": catch_up_window: "soon" is not a duration`},
		{"entries:\n  - schedule: '@hourly'\n    task_type: t\n", `entry #1: name`},
		{"entries:\n  - name: a\n    schedule: '@hourly'\n  - name: b\n    schedule: 'every day'\n    task_type: t\n", `entry "a": task_type: required`},
		{"entries:\n  - name: a\n    schedule: '@hourly'\n  - name: b\n    schedule: 'every day'\n    task_type: t\n", `entry "b": schedule`},
	} {
		_, err := schedule.ParseFile([]byte(c.yaml))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v, want an error with %q", c.yaml, err, c.want)
		}
	}
	_, err = schedule.ParseFile([]byte("entries:\n  - name: a\n    schedule: '@hourly'\n"))
	if !errors.Is(err, schedule.ErrInvalidEntry) {
		t.Errorf("an entry without a task type: %v, want ErrInvalidEntry", err)
	}
}
