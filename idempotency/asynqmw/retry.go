package asynqmw

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/idempotency"
)

// BusyTooLongError reports a key that stayed busy past the busy budget: unlike ErrBusy,
// it is a counted failure.
type BusyTooLongError struct {
	Key   string
	Owner string
	Fence int64
	Age   time.Duration // since the first enqueue, or since the key's generation started
}

func (e *BusyTooLongError) Error() string {
	return fmt.Sprintf("asynqmw: key %s still busy after %s (owner %s, fence %d)", e.Key, e.Age.Round(time.Second), e.Owner, e.Fence)
}

// UnavailableTooLongError reports a task that kept finding Postgres unavailable past the
// busy budget, counted from its first enqueue: unlike idempotency.ErrUnavailable, it is a
// counted failure. It does not wrap Err, whose text it carries.
type UnavailableTooLongError struct {
	Key string
	Age time.Duration // since the first enqueue
	Err error         // the last attempt's error
}

func (e *UnavailableTooLongError) Error() string {
	return fmt.Sprintf("asynqmw: key %s: Postgres still unavailable %s after the first enqueue: %v", e.Key, e.Age.Round(time.Second), e.Err)
}

// unavailable reports an error that says Postgres cannot be reached right now: a ledger
// write's (idempotency.ErrUnavailable: refused, lost, timed out) or pgx's own.
func unavailable(err error) bool {
	return idempotency.IsUnavailable(err)
}

// IsFailure tells asynq which errors count as failures (asynq.Config.IsFailure): a busy
// key or lock does not, nor a Postgres that cannot be reached right now (a restart, a
// failover under way, a ledger write that timed out), so neither burns the retry budget
// (until the busy budget ends: BusyTooLongError, UnavailableTooLongError). A handler's own
// timeout and the delivery's deadline are failures.
func IsFailure(err error) bool {
	return !errors.Is(err, idempotency.ErrBusy) && !errors.Is(err, ErrLockBusy) && !unavailable(err)
}

// RetryDelay tells asynq when to run a task again (asynq.Config.RetryDelayFunc): a busy
// key after half the task's age (from its first-enqueue header; at least 250 ms), but no
// later than when the lease ends; a busy lock, Postgres unavailable, or a lease lost while
// the handler ran (self-fenced while Postgres was out of reach, or taken over), soon
// (within 1.5 s of a failover's end rather than asynq's 15–45 s: the next attempt finds the
// key done, busy until the lease ends, or free); anything else by next (asynq's default
// when nil). A lost lease still counts as a failure (IsFailure), so that a delivery that
// keeps losing it ends in the archive.
func RetryDelay(next asynq.RetryDelayFunc) asynq.RetryDelayFunc {
	if next == nil {
		next = asynq.DefaultRetryDelayFunc
	}
	return func(n int, err error, t *asynq.Task) time.Duration {
		var busy *idempotency.BusyError
		switch {
		case errors.As(err, &busy):
			d := time.Until(busy.Until) + 100*time.Millisecond // the lease's end
			if age, ok := taskAge(t); ok {
				// A key is busy mostly because its first delivery is still running: look
				// again soon, then less and less often (half the task's age), never later
				// than the lease's end.
				d = min(d, max(age/2, 250*time.Millisecond))
			}
			return min(max(d, 200*time.Millisecond), time.Minute) + jitter(250*time.Millisecond)
		case errors.Is(err, ErrLockBusy):
			return 500*time.Millisecond + jitter(500*time.Millisecond)
		case unavailable(err), errors.Is(err, idempotency.ErrLeaseLost):
			return 500*time.Millisecond + jitter(time.Second)
		}
		return next(n, err, t)
	}
}

// Configure sets cfg's IsFailure and RetryDelayFunc for idemq's handlers, keeping cfg's
// own RetryDelayFunc for other errors.
func Configure(cfg *asynq.Config) {
	cfg.IsFailure = IsFailure
	cfg.RetryDelayFunc = RetryDelay(cfg.RetryDelayFunc)
}

func jitter(d time.Duration) time.Duration { return rand.N(d) }

// busyAge is how long a busy key's job has been trying: since the task's first enqueue
// (its header), or, for a task without the header (from a plain asynq producer), since
// the ledger row's generation started. ok is false when neither is known: a row held by a
// transaction, whose wait the session's idle timeout bounds.
func busyAge(t *asynq.Task, busy *idempotency.BusyError) (time.Duration, bool) {
	if age, ok := taskAge(t); ok {
		return age, true
	}
	return busy.Age, busy.Age > 0
}

func taskAge(t *asynq.Task) (time.Duration, bool) {
	if t == nil {
		return 0, false
	}
	first, ok := idempotency.FirstEnqueued(t.Headers())
	if !ok {
		return 0, false
	}
	return time.Since(first), true
}

func lastAttempt(ctx context.Context) bool {
	n, ok1 := asynq.GetRetryCount(ctx)
	m, ok2 := asynq.GetMaxRetry(ctx)
	return ok1 && ok2 && n >= m
}
