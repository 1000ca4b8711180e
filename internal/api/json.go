package api

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/idemq/idemq/idempotency"
)

// Record is a ledger row as the CLI (`idemq ledger show --json`) and the API print it.
type Record struct {
	Key         string          `json:"key"`
	Type        string          `json:"type"`
	Status      string          `json:"status"`
	Fence       int64           `json:"fence"`
	Owner       string          `json:"owner,omitempty"`
	Generation  int             `json:"generation"`
	Attempts    int             `json:"attempts"`
	LastError   string          `json:"last_error,omitempty"`
	Result      json.RawMessage `json:"result,omitempty"`
	LockedUntil *time.Time      `json:"locked_until"`         // in-progress rows only: the lease's end (null otherwise)
	LeaseLive   *bool           `json:"lease_live,omitempty"` // in-progress rows only: false once the lease lapsed (the next delivery takes the key over)
	CreatedAt   time.Time       `json:"created_at"`
	UpdatedAt   time.Time       `json:"updated_at"`
	CompletedAt *time.Time      `json:"completed_at,omitempty"`
	TraceID     string          `json:"trace_id,omitempty"` // the delivery's whose claim holds or did the work
	// Intent is the state of the job's outbox intent (pending, published, done, dead), when
	// it was accepted through the outbox; IntentError is why a dead one died.
	Intent      string `json:"intent,omitempty"`
	IntentError string `json:"intent_error,omitempty"`
	// Steps are the steps recorded in the row's current generation, in the order the run
	// called them; left out when there are none.
	Steps []Step `json:"steps,omitempty"`
	// History is the key's history: its exceptional events (duplicates served, mismatches
	// refused, busy past the budget, takeovers, lost leases, self-fences, needs attention,
	// reruns, republishes), oldest first, the newest idempotency.MaxHistory of them across
	// generations; left out when there are none. Recorded best-effort: a crash may drop
	// an event.
	History []HistoryEntry `json:"history,omitempty"`
}

// HistoryEntry is an event of a key's history as the API and the CLI print it. Fields
// that are not known are left out (task_id: a delivery's asynq TaskID; fence: the claim
// the event is about; old_fence: a takeover's, the fence taken over).
type HistoryEntry struct {
	At         time.Time `json:"at"`
	Kind       string    `json:"kind"`
	Generation int       `json:"generation"`
	TaskType   string    `json:"task_type,omitempty"`
	TaskID     string    `json:"task_id,omitempty"`
	Worker     string    `json:"worker,omitempty"`
	Fence      int64     `json:"fence,omitempty"`
	OldFence   int64     `json:"old_fence,omitempty"`
	Detail     string    `json:"detail,omitempty"`
}

// NewHistory converts a key's history to its JSON shape; none gives nil.
func NewHistory(es []idempotency.HistoryEvent) []HistoryEntry {
	if len(es) == 0 {
		return nil
	}
	out := make([]HistoryEntry, len(es))
	for i, e := range es {
		out[i] = HistoryEntry{At: e.At, Kind: string(e.Kind), Generation: e.Generation, TaskType: e.TaskType, TaskID: e.TaskID,
			Worker: e.Worker, Fence: e.Fence, OldFence: e.OldFence, Detail: e.Detail}
	}
	return out
}

// Step is a recorded step's JSON shape.
type Step struct {
	Name      string          `json:"name"`
	Fence     int64           `json:"fence"` // the fence of the claim that recorded it
	Result    json.RawMessage `json:"result,omitempty"`
	CreatedAt time.Time       `json:"created_at"`
}

// NewSteps converts recorded steps to their JSON shape; none gives nil.
func NewSteps(ss []idempotency.StepRecord) []Step {
	if len(ss) == 0 {
		return nil
	}
	out := make([]Step, len(ss))
	for i, s := range ss {
		out[i] = Step{Name: s.Name, Fence: s.Fence, Result: s.Result, CreatedAt: s.CreatedAt}
	}
	return out
}

// NewRecord converts a ledger row to its JSON shape; zero times are left out, and
// locked_until is null unless the row is in progress.
func NewRecord(r idempotency.Record) Record {
	opt := func(t time.Time) *time.Time {
		if t.IsZero() {
			return nil
		}
		return &t
	}
	// Only a row in progress holds a lease; a finished one keeps its last lease's end in
	// locked_until, which is not shown.
	var live *bool
	var lockedUntil *time.Time
	if r.Status == idempotency.StatusInProgress {
		live, lockedUntil = &r.LeaseLive, opt(r.LockedUntil)
	}
	return Record{Key: r.Key, Type: r.TaskType, Status: r.Status, Fence: r.Fence, Owner: r.Owner,
		Generation: r.Generation, Attempts: r.Attempts, LastError: r.LastError, Result: r.Result,
		LockedUntil: lockedUntil, LeaseLive: live, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt, CompletedAt: opt(r.CompletedAt), TraceID: r.TraceID}
}

// writeJSON writes v with status code.
func writeJSON(w http.ResponseWriter, code int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		code, b = http.StatusInternalServerError, []byte(`{"error":"encode response"}`)
	}
	writeRaw(w, code, b)
}

func writeRaw(w http.ResponseWriter, code int, body []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	w.Write(body)
	w.Write([]byte("\n"))
}

// errorBody is every error the API answers: {"error": "..."}, naming the field at fault.
type errorBody struct {
	Error string `json:"error"`
}

func writeError(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, errorBody{Error: msg})
}
