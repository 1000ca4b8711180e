package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"
)

// DefaultRequestTimeout bounds each request: past it, a stalled Postgres or Redis gets the
// client a 503 with Retry-After instead of a wait. It stays below httpserver's default
// write timeout (60s), which must exceed it.
const DefaultRequestTimeout = 10 * time.Second

// StatusClientClosedRequest is what the API's metrics and logs record for a request whose
// client went away before it was answered (nginx's 499); nothing is sent.
const StatusClientClosedRequest = 499

// retryAfter is the Retry-After, in seconds, of a 503 for a request that ran out of time.
const retryAfter = "2"

// rollbackTimeout bounds the rollback of a request's transaction, which runs even after
// the request's deadline.
const rollbackTimeout = 2 * time.Second

// errRequestTimeout is the cause of a request context that reached its deadline, which
// tells it apart from a client that went away.
var errRequestTimeout = errors.New("api: request timeout")

// timedOut reports whether the request's own deadline has passed.
func timedOut(ctx context.Context) bool {
	return errors.Is(context.Cause(ctx), errRequestTimeout)
}

// clientGone reports whether the request's context ended for another reason than its
// deadline: the client hung up.
func clientGone(ctx context.Context) bool {
	return ctx.Err() != nil && !timedOut(ctx)
}

// setTimeoutsSQL sets statement_timeout ($1) and lock_timeout ($2) for the rest of the
// transaction only, so they survive a transaction-mode pooler and never leak to the next
// user of the session; an empty value leaves that setting as it is.
const setTimeoutsSQL = `SELECT set_config('statement_timeout', coalesce(nullif($1, ''), current_setting('statement_timeout')), true),
	set_config('lock_timeout', coalesce(nullif($2, ''), current_setting('lock_timeout')), true)`

// statementTimeout is the statement_timeout that makes Postgres itself cancel a stalled
// statement (the connection survives) before pgx gives up on the connection at ctx's
// deadline: nine tenths of the time left, "" when ctx has no deadline.
func statementTimeout(ctx context.Context) (string, error) {
	deadline, ok := ctx.Deadline()
	if !ok {
		return "", nil
	}
	left := time.Until(deadline) * 9 / 10
	if left < time.Millisecond {
		return "", context.DeadlineExceeded // 0 would mean no timeout at all
	}
	return fmt.Sprintf("%dms", left.Milliseconds()), nil
}

// unavailable answers 503 with Retry-After: the request ran out of time, and a retry
// (with the same body and Idempotency-Key) is safe.
func unavailable(w http.ResponseWriter, msg string) {
	w.Header().Set("Retry-After", retryAfter)
	writeError(w, http.StatusServiceUnavailable, msg)
}
