package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
)

// jobAccepted is a job known to the API but not yet to the ledger: its intent is recorded
// and waits for a worker.
type jobAccepted struct {
	Key       string `json:"key"`
	Type      string `json:"type"`
	Status    string `json:"status"` // StatusAccepted
	Intent    string `json:"intent,omitempty"`
	LastError string `json:"last_error,omitempty"`
}

// StatusDead is a job's status when its intent is dead: its task was refused (another
// payload took its key, the key failed for good, its payload was invalid), so the job the
// caller was told is accepted never takes effect. last_error says why.
const StatusDead = "dead"

// getJob answers GET /v1/jobs/{key}: the ledger row with its intent's state, or the
// intent's state while no worker has claimed the job yet, or 404. A job whose intent is
// dead is StatusDead whatever the row says: when another payload completed its key, the
// row's result (and its steps) are that payload's, not this job's, and are left out. The
// steps recorded in the row's current generation come as "steps" when there are any; the
// key's history, across generations, as "history".
func (s *Server) getJob(w http.ResponseWriter, r *http.Request) {
	key := r.PathValue("key")
	if err := idempotency.ValidateKey(key); err != nil {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no job with key %q", key))
		return
	}
	rec, err := s.deps.Ledger.Get(r.Context(), key)
	switch {
	case err == nil:
		out := NewRecord(*rec)
		steps, err := s.deps.Ledger.Steps(r.Context(), key)
		if err != nil {
			s.internal(w, r, "read the job's steps", err)
			return
		}
		out.Steps = NewSteps(steps)
		history, err := s.deps.Ledger.History(r.Context(), key)
		if err != nil {
			s.internal(w, r, "read the job's history", err)
			return
		}
		out.History = NewHistory(history)
		acc, ok, err := s.intent(r.Context(), key)
		if err != nil {
			s.internal(w, r, "read the job's intent", err)
			return
		}
		if ok {
			out.Intent = acc.Intent
			if acc.Intent == outbox.IntentDead {
				out.IntentError = acc.LastError
				if out.Status != idempotency.StatusFailed {
					out.Status, out.LastError, out.Result, out.Steps = StatusDead, acc.LastError, nil, nil
				}
			}
		}
		writeJSON(w, http.StatusOK, out)
		return
	case !errors.Is(err, idempotency.ErrNotFound):
		s.internal(w, r, "read the ledger", err)
		return
	}
	acc, ok, err := s.intent(r.Context(), key)
	if err != nil {
		s.internal(w, r, "read the job's intent", err)
		return
	}
	if !ok {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no job with key %q", key))
		return
	}
	writeJSON(w, http.StatusOK, acc)
}

// intent finds a job that the ledger does not know yet: through the Enqueuer when it can
// look intents up, else through the Idempotency-Key rows that named it.
func (s *Server) intent(ctx context.Context, key string) (jobAccepted, bool, error) {
	if il, ok := s.deps.Enqueuer.(IntentLookup); ok {
		in, err := il.Intent(ctx, key)
		if errors.Is(err, idempotency.ErrNotFound) {
			return jobAccepted{}, false, nil
		}
		if err != nil {
			return jobAccepted{}, false, err
		}
		acc := jobAccepted{Key: key, Type: in.TaskType, Status: StatusAccepted, Intent: in.State, LastError: in.LastError}
		if in.State == outbox.IntentDead {
			acc.Status = StatusDead
		}
		return acc, true, nil
	}
	typ, err := outbox.RequestKeyJob(ctx, s.deps.Pool, key)
	if errors.Is(err, idempotency.ErrNotFound) {
		return jobAccepted{}, false, nil
	}
	if err != nil {
		return jobAccepted{}, false, err
	}
	return jobAccepted{Key: key, Type: typ, Status: StatusAccepted}, true, nil
}

// internal answers an error of the API's own (Postgres, Redis), which it logs but never
// sends: 503 with Retry-After when the request ran out of time (its deadline passed, or
// Postgres cancelled a statement at the statement_timeout set below it) or the database
// is unavailable (a lost connection, a failover under way), 500 otherwise.
// When the client went away it writes nothing: ServeHTTP records the request as 499.
func (s *Server) internal(w http.ResponseWriter, r *http.Request, what string, err error) {
	ctx := r.Context()
	switch {
	case clientGone(ctx):
		s.log.DebugContext(ctx, "api: "+what, "method", r.Method, "path", r.URL.Path, "err", err)
	case timedOut(ctx) || errors.Is(err, context.DeadlineExceeded) || idempotency.IsQueryCanceled(err):
		s.log.WarnContext(ctx, "api: "+what+": timed out", "method", r.Method, "path", r.URL.Path, "err", err)
		unavailable(w, what+": timed out; retry later")
	case idempotency.IsUnavailable(err):
		s.log.WarnContext(ctx, "api: "+what+": database unavailable", "method", r.Method, "path", r.URL.Path, "err", err)
		unavailable(w, what+": the database is unavailable; retry later")
	default:
		s.log.ErrorContext(ctx, "api: "+what, "method", r.Method, "path", r.URL.Path, "err", err)
		writeError(w, http.StatusInternalServerError, what+": internal error")
	}
}
