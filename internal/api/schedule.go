package api

import (
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/idemq/idemq/idempotency/schedule"
)

// ScheduleEntry is a schedule entry as the CLI (`idemq schedule list --json`) and the API
// (GET /v1/schedule) print it.
type ScheduleEntry struct {
	Name     string          `json:"name"`
	Schedule string          `json:"schedule,omitempty"`
	TimeZone string          `json:"time_zone,omitempty"`
	TaskType string          `json:"task_type,omitempty"`
	Payload  json.RawMessage `json:"payload,omitempty"`
	Revision int64           `json:"revision"`
	Paused   bool            `json:"paused"`
	CatchUp  string          `json:"catch_up,omitempty"`
	Overlap  string          `json:"overlap,omitempty"`
	// LastTick is the newest tick any replica enqueued, LastKey its job's key and
	// LastState its outbox intent's state (left out when the intent is gone).
	LastTick  *time.Time `json:"last_tick,omitempty"`
	LastKey   string     `json:"last_key,omitempty"`
	LastState string     `json:"last_state,omitempty"`
	Next      *time.Time `json:"next_tick,omitempty"`
	// Error says why this build cannot read the entry (another replica's newer
	// revision, say); the fields but the name and revision may then be empty.
	Error string `json:"error,omitempty"`
}

// NewScheduleEntries converts schedule.List's entries to their JSON shape; zero times are
// left out. None gives an empty slice, which encodes as [].
func NewScheduleEntries(list []schedule.Status) []ScheduleEntry {
	out := make([]ScheduleEntry, 0, len(list))
	for _, s := range list {
		e := ScheduleEntry{Name: s.Name, Schedule: s.Schedule, TimeZone: s.TimeZone, TaskType: s.TaskType, Payload: s.Payload,
			Revision: s.Revision, Paused: s.Paused, CatchUp: string(s.CatchUp), Overlap: string(s.Overlap),
			LastKey: s.LastKey, LastState: s.LastState}
		if !s.LastTick.IsZero() {
			t := s.LastTick
			e.LastTick = &t
		}
		if !s.Next.IsZero() {
			t := s.Next
			e.Next = &t
		}
		if s.Err != nil {
			e.Error = s.Err.Error()
		}
		out = append(out, e)
	}
	return out
}

// scheduleList is GET /v1/schedule's answer.
type scheduleList struct {
	Entries []ScheduleEntry `json:"entries"`
}

// getSchedule answers GET /v1/schedule: every entry of the schedule table, by name, with
// its last and next tick.
func (s *Server) getSchedule(w http.ResponseWriter, r *http.Request) {
	list, err := schedule.List(r.Context(), s.deps.Pool, time.Now())
	if err != nil {
		s.internal(w, r, "read the schedule", err)
		return
	}
	writeJSON(w, http.StatusOK, scheduleList{Entries: NewScheduleEntries(list)})
}

// schedulePage serves /schedule/: the schedule table, read-only, each entry's last job
// linked to its row page.
func (s *Server) schedulePage(w http.ResponseWriter, r *http.Request) {
	list, err := schedule.List(r.Context(), s.deps.Pool, time.Now())
	if err != nil {
		s.internal(w, r, "read the schedule", err)
		return
	}
	s.render(w, http.StatusOK, "schedule.html", list)
}

// scheduleEntryOf returns the name of the schedule entry whose scheduler keys its jobs
// like key (schedule.TickKey, schedule.ManualKey: cron:<name>:...), or "" for any other
// key.
func scheduleEntryOf(key string) string {
	rest, ok := strings.CutPrefix(key, "cron:")
	if !ok {
		return ""
	}
	name, _, ok := strings.Cut(rest, ":")
	if !ok || name == "" || len(name) > schedule.MaxName {
		return ""
	}
	for _, c := range []byte(name) {
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '_' || c == '-') {
			return ""
		}
	}
	return name
}

// scheduleLink is an entry's line on the schedule page.
func scheduleLink(name string) string {
	return "/schedule/#" + url.PathEscape("entry-"+name)
}
