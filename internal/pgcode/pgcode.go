// Package pgcode names the Postgres SQLSTATEs idemq acts on, once.
package pgcode

// SQLSTATEs (Appendix A of the PostgreSQL manual).
const (
	// DataExceptionClass is the class (first two characters) of data exceptions, such as
	// a value jsonb refuses.
	DataExceptionClass = "22"
	// DivisionByZero is raised on purpose by the DoTx completion when its fenced update
	// matched no row, so that the whole transaction aborts.
	DivisionByZero       = "22012"
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
)
