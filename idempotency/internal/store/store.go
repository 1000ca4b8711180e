// Package store is the only Go of the ledger that speaks SQL: the statements on
// processed_jobs and job_intents, their typed parameters and rows, and the pipeline that
// sends a round of them and learns its transaction id before the commit is asked for.
// Each operation has one statement, whatever the number of rows: a single row is a
// batch of one. The statements' text is in sql/, a file per statement (see sql.go).
//
// Beside them, what every caller that speaks to Postgres shares: the SQLSTATEs idemq
// acts on, named once, and Unavailable, which tells errors that mean "the database is
// unavailable" from the others (pgcode.go); text made safe to store, error text in a text
// column and JSON in a jsonb one (pgtext.go); and CommitXact, which commits a transaction
// whose COMMIT may lose its answer (the connection breaks after the COMMIT was sent) and
// then learns from the server, by transaction id, whether it committed, so that a caller
// never reports as done what did not commit, nor as failed what did (xact.go).
//
// Store rules: no session state (settings are set_config(…, true), for the transaction);
// statements are named prepared statements only when the pool's exec mode caches
// statements (Prepared), otherwise they are sent unnamed, their parameter types described
// once.
package store

import (
	"bytes"
	"context"
	"crypto/rand"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// Statuses of a ledger row (the status column).
const (
	StatusInProgress     = "in_progress"
	StatusCompleted      = "completed"
	StatusFailed         = "failed"
	StatusNeedsAttention = "needs_attention"
)

// Action is what a finish does with a claimed row.
type Action string

// Actions of FinishMany (complete, retry, fail) and of a DoTx finish (complete, fail).
const (
	ActionComplete Action = "complete" // completed, with its result
	ActionRetry    Action = "retry"    // the lease ends at once; the row stays in progress
	ActionFail     Action = "fail"     // failed for good
)

// Statement is a statement sent by Round: named and prepared once per connection when
// the pool prepares, otherwise unnamed with its parameter types described once. One with
// ParamOIDs is never prepared nor described: it is sent unnamed with those types, so that
// the server reads its tables (and takes their locks) only when it runs, under the
// lock_timeout of its transaction.
type Statement struct {
	Name, SQL string
	ParamOIDs []uint32

	mu        sync.Mutex
	paramOIDs []uint32
}

// paramTypes returns the statement's parameter types, described by the server (as an
// unnamed statement) the first time.
func (s *Statement) paramTypes(ctx context.Context, conn *pgconn.PgConn) ([]uint32, error) {
	if s.ParamOIDs != nil {
		return s.ParamOIDs, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.paramOIDs == nil {
		sd, err := conn.Prepare(ctx, "", s.SQL, nil)
		if err != nil {
			return nil, err
		}
		s.paramOIDs = sd.ParamOIDs
	}
	return s.paramOIDs, nil
}

// ClaimParams is one key to claim.
type ClaimParams struct {
	Key, TaskType string
	Owner         pgtype.UUID
	Fingerprint   []byte // nil: not compared
	Lease         time.Duration
	TraceID       string // the claiming delivery's, "" when it is not traced
}

// ClaimRow is what a claim found or wrote for its key.
type ClaimRow struct {
	// Claimed: the key was taken (Fence is the claim's, Attempts its attempt). Attempted
	// (a leased claim): it was tried (the key looked claimable) but took nothing, a race
	// with a concurrent change; (a DoTx read) the key may be taken, but another
	// transaction holds it: busy.
	Claimed, Attempted bool
	Status             pgtype.Text // invalid: no row
	Fence              pgtype.Int8
	Owner              pgtype.UUID
	Fingerprint        []byte
	Result             []byte
	Attempts           pgtype.Int4
	LastError          pgtype.Text
	LockedUntil        pgtype.Timestamptz
	StartedAt          pgtype.Timestamptz
	CompletedAt        pgtype.Timestamptz
	Generation         pgtype.Int4
	DBNow              time.Time
	// PrevFence (Claimed) is the fence of the claim taken over, as the claim's statement
	// read it; not valid for a new key.
	PrevFence pgtype.Int8
}

// Verdict is what a claim's row says of its key.
type Verdict uint8

// Verdicts of a claim's row (ClaimRow.Verdict).
const (
	Unread         Verdict = iota // no row was read
	Claimed                       // taken: Fence is the claim's, Attempts its attempt
	Cached                        // completed: the stored result answers
	Busy                          // held: under a live lease, or (a DoTx read) by another transaction
	Mismatch                      // another payload's fingerprint
	Failed                        // failed for good
	NeedsAttention                // waits for an operator
	Stuck                         // in progress past the maximum age, its lease ended: to be marked needs_attention
	Race                          // not taken, yet nothing stood in the way: a race with a concurrent change
)

// Verdict classifies r for a claim whose payload has fingerprint fp (nil: not compared),
// with the maximum age maxAge.
func (r *ClaimRow) Verdict(fp []byte, maxAge time.Duration) Verdict {
	switch {
	case r.Claimed:
		return Claimed
	case r.Attempted: // only a DoTx read answers it: another transaction holds the key
		return Busy
	case !r.Status.Valid: // no row visible, yet the insert conflicted
		return Race
	case r.Fingerprint != nil && fp != nil && !bytes.Equal(r.Fingerprint, fp):
		return Mismatch
	case r.Status.String == StatusCompleted:
		return Cached
	case r.Status.String == StatusFailed:
		return Failed
	case r.Status.String == StatusNeedsAttention:
		return NeedsAttention
	case !r.LockedUntil.Time.Before(r.DBNow):
		return Busy
	case r.StartedAt.Time.Before(r.DBNow.Add(-maxAge)):
		return Stuck
	}
	return Race
}

// NewOwner returns a claim's owner id: a random (version 4) UUID.
func NewOwner() (pgtype.UUID, error) {
	u := pgtype.UUID{Valid: true}
	if _, err := rand.Read(u.Bytes[:]); err != nil {
		return pgtype.UUID{}, err
	}
	u.Bytes[6] = u.Bytes[6]&0x0f | 0x40 // version 4
	u.Bytes[8] = u.Bytes[8]&0x3f | 0x80 // RFC 4122 variant
	return u, nil
}

// targets are the scan destinations of a claim row's columns, in order, after lead.
func (r *ClaimRow) targets(lead ...any) []any {
	return append(lead, &r.Claimed, &r.Attempted, &r.Status, &r.Fence, &r.Owner, &r.Fingerprint,
		&r.Result, &r.Attempts, &r.LastError, &r.LockedUntil, &r.StartedAt, &r.CompletedAt,
		&r.Generation, &r.DBNow, nil, nil, &r.PrevFence)
}

// FinishParams is one claimed row to end: its claim (key, fence, owner), the action, and
// the result and error to store (NULL when not valid).
type FinishParams struct {
	Key           string
	Fence         int64
	Owner         pgtype.UUID
	Action        Action
	Result, Error pgtype.Text
	// IntentSum says whether a completion or permanent failure settles the key's outbox
	// intent: nil settles it (the caller did not say which task it ran); otherwise only an
	// intent whose payload_sha256 equals it (the delivery was of the intent's own task,
	// whose payload is the intent's bytes) is settled. An empty, non-nil sum settles none.
	IntentSum []byte
	// A DoTx finish writes the whole row: these too; Found: the read found a row (taken
	// over), else the key had none.
	Found               bool
	TaskType            string
	Fingerprint         []byte
	Attempt, Generation int
	TraceID             string
}

// Finished is what a finish answers for a row it changed: the transaction's id and the
// server's start time, which identify the transaction should its commit's answer be lost.
type Finished struct{ XID, ServerStart string }
