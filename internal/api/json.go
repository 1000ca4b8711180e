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
	LockedUntil *time.Time      `json:"locked_until,omitempty"`
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

// NewRecord converts a ledger row to its JSON shape; zero times are left out.
func NewRecord(r idempotency.Record) Record {
	opt := func(t time.Time) *time.Time {
		if t.IsZero() {
			return nil
		}
		return &t
	}
	var live *bool
	if r.Status == idempotency.StatusInProgress {
		live = &r.LeaseLive
	}
	return Record{Key: r.Key, Type: r.TaskType, Status: r.Status, Fence: r.Fence, Owner: r.Owner,
		Generation: r.Generation, Attempts: r.Attempts, LastError: r.LastError, Result: r.Result,
		LockedUntil: opt(r.LockedUntil), LeaseLive: live, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt, CompletedAt: opt(r.CompletedAt), TraceID: r.TraceID}
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
