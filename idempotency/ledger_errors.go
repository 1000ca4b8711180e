package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/idempotency/internal/store"
)

// Sentinel errors. Compare with errors.Is: the errors returned by the Ledger wrap them,
// usually with the key.
var (
	// ErrLeaseLost means a fenced write (Heartbeat, Complete, Fail, a step's record)
	// matched no row: another claim took the key over, an operator released it, or the
	// lease was given up because no heartbeat reached the database in time. The caller's
	// result was not recorded.
	ErrLeaseLost = errors.New("idempotency: lease lost")
	// ErrBusy means another claim holds a live lease on the key (or an uncommitted
	// transaction holds its row). It is not a failure: retry when the lease ends. The
	// returned error is a *BusyError.
	ErrBusy = errors.New("idempotency: key busy")
	// ErrFailed means the key ended in the terminal state failed. Deliveries never run it
	// again; only Ledger.Rerun does. The returned error is a *FailedError.
	ErrFailed = errors.New("idempotency: key failed permanently")
	// ErrMismatch means the key was first claimed with another fingerprint (another
	// payload). It is permanent; no result is served. The returned error is a
	// *MismatchError.
	ErrMismatch = errors.New("idempotency: payload fingerprint mismatch")
	// ErrNeedsAttention means the key was in progress for longer than Config.MaxAge without
	// completing. It is not run again (an effect that old may be outside a provider's
	// idempotency window); an operator decides, with Ledger.Rerun.
	ErrNeedsAttention = errors.New("idempotency: key needs attention")
	// ErrNotFound means the ledger has no row for the key.
	ErrNotFound = errors.New("idempotency: key not found")
	// ErrInvalidKey means a key is not 1..255 bytes of printable ASCII without spaces.
	ErrInvalidKey = errors.New("idempotency: invalid key")
	// ErrInvalidRequest means a Request field other than the key is invalid (task type
	// empty or longer than 255 bytes, fingerprint not 32 bytes).
	ErrInvalidRequest = errors.New("idempotency: invalid request")
	// ErrNotInProgress is returned by Ledger.Release for a key that is not in progress.
	ErrNotInProgress = errors.New("idempotency: key not in progress")
	// ErrNotTerminal is returned by Ledger.Rerun for a key that is still in progress.
	ErrNotTerminal = errors.New("idempotency: key not terminal")
	// ErrCommitUnknown means the connection was lost while a completion committed and the
	// outcome could not be learned from the transaction id before the context ended. The
	// error also wraps ErrUnavailable.
	ErrCommitUnknown = errors.New("idempotency: commit outcome unknown")
	// ErrUnavailable means a ledger write (a claim, heartbeat, completion or failure, or
	// the resolution of a commit whose answer was lost) could not reach Postgres or hear
	// its answer: a connection refused or lost, a server shutting down, starting or not yet
	// promoted, no connection slot free, or a write that timed out (Config.WriteTimeout, a
	// connect or read timeout). Nothing says the request is wrong: retry soon. The end of
	// the caller's own context (a delivery's deadline) is not unavailability, nor is an
	// error a handler returns. The write's effect, if any, is read from the ledger by the
	// next attempt (a completed key answers with its result; an unended lease is busy).
	ErrUnavailable = errors.New("idempotency: database unavailable")
)

// unavailableError marks a ledger write's error as ErrUnavailable, keeping its message.
type unavailableError struct{ err error }

func (e *unavailableError) Error() string        { return e.err.Error() }
func (e *unavailableError) Unwrap() error        { return e.err }
func (e *unavailableError) Is(target error) bool { return target == ErrUnavailable }

// asUnavailable marks err, a ledger write's error, as ErrUnavailable when it says that
// Postgres could not be reached or did not answer in time (see ErrUnavailable). A timeout
// counts only while caller, the context the write was made for, has not ended: a write
// cut short by the caller's own deadline is the caller's doing.
func asUnavailable(caller context.Context, err error) error {
	if err == nil || errors.Is(err, ErrUnavailable) {
		return err
	}
	if unreachable(caller, err) {
		return &unavailableError{err: err}
	}
	return err
}

// IsUnavailable reports whether err says that Postgres cannot be reached or is not taking
// writes right now: a ledger write's ErrUnavailable, or such an error of pgx's own (a
// connection refused or lost, a server shutting down, crashing or starting, a standby not
// promoted yet, no connection slot free). A later retry may succeed; nothing in err says
// the request itself is wrong.
func IsUnavailable(err error) bool {
	return errors.Is(err, ErrUnavailable) || store.Unavailable(err)
}

// IsLockTimeout reports whether err says that Postgres gave up waiting for a lock that
// another transaction holds (SQLSTATE 55P03, lock_not_available: the wait reached the
// lock_timeout, or the statement asked not to wait).
func IsLockTimeout(err error) bool { return store.IsCode(err, store.LockNotAvailable) }

// IsQueryCanceled reports whether err says that Postgres cancelled the statement
// (SQLSTATE 57014, query_canceled: it ran past its statement_timeout, or a cancel request
// reached it). The connection survives it.
func IsQueryCanceled(err error) bool { return store.IsCode(err, store.QueryCanceled) }

// unreachable reports whether err, a ledger write's error, says that Postgres could not
// be reached or did not answer in time while caller had not ended (see asUnavailable).
func unreachable(caller context.Context, err error) bool {
	return store.Unavailable(err) || (caller.Err() == nil && timedOut(err))
}

// timedOut reports a timeout: a context deadline, or a network timeout pgx reports.
func timedOut(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err)
}

// BusyError reports a key held by another claim. Owner, Fence and Until are zero when
// the holder is an uncommitted transaction (DoTx) or when a lock or serialization wait
// was cut short (SQLSTATE 55P03, 40001, 40P01).
type BusyError struct {
	Key   string
	Owner string    // the holder's owner id (a UUID)
	Fence int64     // the holder's fence
	Until time.Time // when the holder's lease ends, by the database clock
	// Age is how long the key has been in progress: since its generation started (the
	// first claim, or the operator's re-run), by the database clock. Zero when unknown (the
	// row is held by a transaction, or the claim lost its races).
	Age time.Duration
	// Generation is the held row's generation (0 when unknown, as Age).
	Generation int
}

func (e *BusyError) Error() string {
	if e.Fence == 0 {
		return fmt.Sprintf("idempotency: key %q busy (held by a transaction)", e.Key)
	}
	return fmt.Sprintf("idempotency: key %q busy: owner %s fence %d until %s",
		e.Key, e.Owner, e.Fence, e.Until.UTC().Format(time.RFC3339Nano))
}

// Is reports whether target is ErrBusy.
func (e *BusyError) Is(target error) bool { return target == ErrBusy }

// FailedError reports a key in the terminal state failed, with the error recorded when it
// failed.
type FailedError struct {
	Key       string
	LastError string
}

func (e *FailedError) Error() string {
	return fmt.Sprintf("idempotency: key %q failed permanently: %s", e.Key, e.LastError)
}

// Is reports whether target is ErrFailed.
func (e *FailedError) Is(target error) bool { return target == ErrFailed }

// MismatchError reports a key whose stored fingerprint differs from the request's.
type MismatchError struct {
	Key string
}

func (e *MismatchError) Error() string {
	return fmt.Sprintf("idempotency: key %q was claimed with another payload", e.Key)
}

// Is reports whether target is ErrMismatch.
func (e *MismatchError) Is(target error) bool { return target == ErrMismatch }

// permanentError marks a handler error as permanent.
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent marks err as permanent: Fail (and Do, DoTx) record the key as failed, a
// terminal state, instead of ending the lease for a retry. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

// IsPermanent reports whether err, or an error it wraps, was marked with Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}

// refused is the error of a DoTx statement the server refused: the claim (claim), or the
// claimed row's write or its result. A result jsonb refuses (a data exception) is
// recorded for good; see claimError for the rest.
func (l *Ledger) refused(ctx context.Context, req Request, err error, claim bool) error {
	var pgErr *pgconn.PgError
	isPg := errors.As(err, &pgErr)
	switch {
	case !claim && isPg && pgErr.Code[:2] == store.DataExceptionClass:
		return Permanent(fmt.Errorf("idempotency: result refused by the database: %s", pgErr.Message))
	case claim || isRetryable(err) || isPg && pgErr.Code == store.CheckViolation:
		return asUnavailable(ctx, l.claimError(req, err)) // an invalid key; busy: a row lock waited for too long
	}
	return asUnavailable(ctx, fmt.Errorf("idempotency: complete %s: %w", req.Key, err))
}

// claimError translates a claim's database error: lock, serialization and deadlock
// failures mean another session holds the key.
func (l *Ledger) claimError(req Request, err error) error {
	if isRetryable(err) {
		l.observe(EventBusy, req.TaskType)
		return fmt.Errorf("%w: %w", &BusyError{Key: req.Key}, err)
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == store.CheckViolation && (pgErr.ConstraintName == "processed_jobs_key_check" || pgErr.ConstraintName == "processed_jobs_key_no_hash_check") {
		return fmt.Errorf("%w: %w", ErrInvalidKey, err)
	}
	return fmt.Errorf("idempotency: claim %s: %w", req.Key, err)
}

// isRetryable reports serialization failures, deadlocks and lock timeouts.
func isRetryable(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code {
	case store.SerializationFailure, store.DeadlockDetected, store.LockNotAvailable:
		return true
	}
	return false
}
