package store

import (
	"errors"
	"io"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// The Postgres SQLSTATEs idemq acts on, named once, and the errors that mean "the
// database is unavailable", told from the others.

// SQLSTATEs (Appendix A of the PostgreSQL manual).
const (
	// DataExceptionClass is the class (first two characters) of data exceptions, such as
	// a value jsonb refuses.
	DataExceptionClass = "22"
	// DivisionByZero is raised on purpose by the DoTx finish when it did not write every
	// member's row, so that the whole transaction aborts.
	DivisionByZero = "22012"
	// UniqueViolation is what the DoTx finish meets when a key it read without a row has
	// one by then: the transaction aborts, as for DivisionByZero.
	UniqueViolation      = "23505"
	CheckViolation       = "23514"
	SerializationFailure = "40001"
	DeadlockDetected     = "40P01"
	LockNotAvailable     = "55P03"
	// QueryCanceled is a statement cancelled, e.g. at its statement_timeout.
	QueryCanceled = "57014"
	// DuplicatePreparedStatement and InvalidSQLStatementName are what named prepared
	// statements meet behind a transaction-mode pooler, whose server connections change
	// from one transaction to the next.
	DuplicatePreparedStatement = "42P05"
	InvalidSQLStatementName    = "26000"
	// ReadOnlySQLTransaction is a write refused by a standby (one not yet promoted).
	ReadOnlySQLTransaction = "25006"
	TooManyConnections     = "53300"
	AdminShutdown          = "57P01"
	CrashShutdown          = "57P02"
	CannotConnectNow       = "57P03"
	// ConnectionExceptionClass is the class of lost and refused connections (also what
	// PgBouncer answers when it runs out of server connections or waits too long).
	ConnectionExceptionClass = "08"
)

// IsCode reports whether err, from pgx, is the server's error with one of codes.
func IsCode(err error, codes ...string) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return false
	}
	for _, c := range codes {
		if pe.Code == c {
			return true
		}
	}
	return false
}

// Unavailable reports whether err, from pgx, says that the database cannot be reached or
// is not taking writes right now: a connection refused or lost, a server shutting down,
// crashing or starting, a standby not promoted yet, no connection slot free. A later retry
// may succeed; nothing in err says the request itself is wrong. Network errors count only
// as pgx reports them (a connect error, a connection that ended mid-answer), so an HTTP
// call's failure does not.
func Unavailable(err error) bool {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch pe.Code {
		case ReadOnlySQLTransaction, TooManyConnections, AdminShutdown, CrashShutdown, CannotConnectNow:
			return true
		}
		return strings.HasPrefix(pe.Code, ConnectionExceptionClass)
	}
	var ce *pgconn.ConnectError
	return errors.As(err, &ce) || errors.Is(err, io.ErrUnexpectedEOF) || pgconn.SafeToRetry(err)
}
