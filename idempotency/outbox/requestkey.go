package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// An HTTP API that accepts jobs can honour the Idempotency-Key request header (the IETF
// httpapi idempotency-key draft) with request keys: in the transaction that records a
// job's intent (EnqueueManyTx), it records the header's key with the fingerprint of the
// request's body, the job the request named and the answer it got, so that a repeat of
// the key gets the first answer again, and a repeat with another body a refusal. The
// records live in the table api_idempotency_keys, one per route and key.

// RequestKeyID names a request key: the route it was sent to, its scope, and the
// Idempotency-Key header's value.
type RequestKeyID struct{ Route, Key string }

// RequestKey is a request key's record.
type RequestKey struct {
	Route string // the key's scope: the route the request was sent to
	Key   string // the Idempotency-Key header's value, 1 to 255 printable ASCII bytes
	// Fingerprint is the request body's, 32 bytes (idempotency.Fingerprint).
	Fingerprint []byte
	// JobKey and TaskType are the job the request named.
	JobKey, TaskType string
	// Code and Body are the answer to replay: its HTTP status and its body. Code is 0
	// while the transaction that records the key is open.
	Code int
	Body []byte
}

// ID returns k's name.
func (k RequestKey) ID() RequestKeyID { return RequestKeyID{k.Route, k.Key} }

// QueueRecordRequestKeys queues on b (a batch for the transaction that records the keys'
// jobs, EnqueueManyTx) the recording of those of keys that are not recorded yet, in one
// statement; when the batch's results are read, recorded has been called with the ID of
// each key it recorded. A key recorded before is left as it is (read it with
// ReadRequestKeysTx); one that a transaction still open recorded makes the statement wait
// for it, up to the transaction's lock_timeout (then the batch fails with an error for
// which idempotency.IsLockTimeout reports true).
func QueueRecordRequestKeys(b *pgx.Batch, keys []RequestKey, recorded func(RequestKeyID)) {
	store.QueueInsertRequestKeys(b, toStoreKeys(keys), func(id store.RequestKeyID) { recorded(RequestKeyID(id)) })
}

// ReadRequestKeysTx returns the records of ids as tx sees them, by ID; an ID without one
// is absent.
func ReadRequestKeysTx(ctx context.Context, tx pgx.Tx, ids []RequestKeyID) (map[RequestKeyID]RequestKey, error) {
	got, err := store.ReadRequestKeys(ctx, tx, toStoreIDs(ids))
	if err != nil {
		return nil, err
	}
	out := make(map[RequestKeyID]RequestKey, len(got))
	for id, k := range got {
		out[RequestKeyID(id)] = RequestKey(k)
	}
	return out, nil
}

// AnswerRequestKeysTx records, inside tx, the answer (Code and Body) of each of keys,
// recorded before; the other fields are not read.
func AnswerRequestKeysTx(ctx context.Context, tx pgx.Tx, keys []RequestKey) error {
	return store.AnswerRequestKeys(ctx, tx, toStoreKeys(keys))
}

// ForgetRequestKeysTx deletes, inside tx, the records of ids: a request refused once the
// transaction that recorded its key had begun leaves no record, as if never sent.
func ForgetRequestKeysTx(ctx context.Context, tx pgx.Tx, ids []RequestKeyID) error {
	return store.ForgetRequestKeys(ctx, tx, toStoreIDs(ids))
}

// purgeBatch is how many request keys one statement of PurgeRequestKeys deletes.
const purgeBatch = 1000

// PurgeRequestKeys deletes the request keys recorded longer ago than olderThan, in
// batches of 1,000, one statement each, and returns how many it deleted (also when it
// returns an error, with those deleted until then). A key repeated after that is a new
// request; its job's key still dedups it. Safe to run on every replica.
func PurgeRequestKeys(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, olderThan time.Duration) (int64, error) {
	var total int64
	for {
		n, err := store.PurgeRequestKeys(ctx, q, olderThan, purgeBatch)
		if err != nil {
			return total, err
		}
		total += n
		if n < purgeBatch {
			return total, nil
		}
	}
}

// RequestKeyJob returns the task type of job jobKey, as an answered request key that
// named it records, or an error wrapping idempotency.ErrNotFound when none does: it finds
// a job an API accepted with an Idempotency-Key but without the outbox's intents (an
// Enqueuer of its own).
func RequestKeyJob(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, jobKey string) (taskType string, err error) {
	taskType, ok, err := store.RequestKeyJob(ctx, q, jobKey)
	if err == nil && !ok {
		err = fmt.Errorf("%w: no request key names job %q", idempotency.ErrNotFound, jobKey)
	}
	return taskType, err
}

func toStoreKeys(keys []RequestKey) []store.RequestKey {
	out := make([]store.RequestKey, len(keys))
	for i, k := range keys {
		out[i] = store.RequestKey(k)
	}
	return out
}

func toStoreIDs(ids []RequestKeyID) []store.RequestKeyID {
	out := make([]store.RequestKeyID, len(ids))
	for i, id := range ids {
		out[i] = store.RequestKeyID(id)
	}
	return out
}
