package tasks_test

import (
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/tasks"
)

func TestDecodeSettle(t *testing.T) {
	s, err := tasks.DecodeSettle([]byte(`{"schedule_entry":"settle-hourly","tick":"2026-12-03T10:00:00Z","period":"1h"}`))
	if err != nil {
		t.Fatal(err)
	}
	if s.Key() != "cron:settle-hourly:2026-12-03T10:00:00Z" || s.LockScope() != "" {
		t.Errorf("key %q scope %q", s.Key(), s.LockScope())
	}
	start, end := s.Span()
	if !end.Equal(time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)) || end.Sub(start) != time.Hour {
		t.Errorf("span (%v, %v]", start, end)
	}
	m, err := tasks.DecodeSettle([]byte(`{"schedule_entry":"settle-hourly","tick":"2026-12-03T10:00:07Z","manual_run":"r1","period":"24h"}`))
	if err != nil || m.Key() != "cron:settle-hourly:manual:r1" {
		t.Errorf("manual run: %q %v", m.Key(), err)
	}
	for payload, want := range map[string]string{
		`{"schedule_entry":"s","tick":"2026-12-03T10:00:00Z","period":"0s"}`:           "period",
		`{"schedule_entry":"s","tick":"2026-12-03T10:00:00Z","period":"1h","extra":1}`: "extra",
		`{"schedule_entry":"s","period":"1h"}`:                                         "tick",
		`{"schedule_entry":"has space","tick":"2026-12-03T10:00:00Z","period":"1h"}`:   "schedule_entry",
		`{"schedule_entry":"s","tick":"2026-12-03T10:00:00Z","period":"1000h"}`:        "period",
	} {
		if _, err := tasks.DecodeSettle([]byte(payload)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error naming %s", payload, err, want)
		}
	}
}
