package store

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The HTTP Idempotency-Keys an API records with the jobs it accepts
// (api_idempotency_keys): one row per route and header key, with the fingerprint of the
// request's body, the job it named and the answer it got.

// RequestKeyID names a request key's row: its route and the header's value. Its fields
// are those of outbox.RequestKeyID.
type RequestKeyID struct{ Route, Key string }

// RequestKey is a request key's row. Its fields are those of outbox.RequestKey, in the
// same order (the outbox converts one to the other).
type RequestKey struct {
	Route, Key       string
	Fingerprint      []byte
	JobKey, TaskType string
	Code             int // the answer's status; 0: none (NULL)
	Body             []byte
}

// insertRequestKeysSQL records many request keys in one statement, each with its
// answer, and returns those it recorded (insert_request_keys.sql).
var insertRequestKeysSQL = sqlText("insert_request_keys", nil)

// QueueInsertRequestKeys queues on b the insert of ks's rows that are not there yet; once
// b's results are read, inserted has been called with each row it inserted.
func QueueInsertRequestKeys(b *pgx.Batch, ks []RequestKey, inserted func(RequestKeyID)) {
	n := len(ks)
	routes, hks, jobKeys, types := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	fps, bodies, codes := make([][]byte, n), make([][]byte, n), make([]*int32, n)
	for i, k := range ks {
		routes[i], hks[i], fps[i], jobKeys[i], types[i], bodies[i] = k.Route, k.Key, k.Fingerprint, k.JobKey, k.TaskType, k.Body
		codes[i] = statusCode(k.Code)
	}
	b.Queue(insertRequestKeysSQL, routes, hks, fps, jobKeys, types, codes, bodies).Query(func(rows pgx.Rows) error {
		var id RequestKeyID
		_, err := pgx.ForEachRow(rows, []any{&id.Route, &id.Key}, func() error {
			inserted(id)
			return nil
		})
		return err
	})
}

// statusCode is code as the status_code column holds it: NULL for 0.
func statusCode(code int) *int32 {
	if code == 0 {
		return nil
	}
	c := int32(code)
	return &c
}

// requestKeyArrays returns the routes and header keys of ids, as two arrays.
func requestKeyArrays(ids []RequestKeyID) (routes, hks []string) {
	routes, hks = make([]string, len(ids)), make([]string, len(ids))
	for i, id := range ids {
		routes[i], hks[i] = id.Route, id.Key
	}
	return routes, hks
}

// readRequestKeysSQL reads the rows of request keys (read_request_keys.sql).
var readRequestKeysSQL = sqlText("read_request_keys", nil)

// ReadRequestKeys returns the rows of ids that are there, by id.
func ReadRequestKeys(ctx context.Context, q DB, ids []RequestKeyID) (map[RequestKeyID]RequestKey, error) {
	routes, hks := requestKeyArrays(ids)
	rows, err := q.Query(ctx, readRequestKeysSQL, PlanEach, routes, hks)
	if err != nil {
		return nil, err
	}
	got := make(map[RequestKeyID]RequestKey, len(ids))
	var k RequestKey
	var code *int32
	_, err = pgx.ForEachRow(rows, []any{&k.Route, &k.Key, &k.Fingerprint, &k.JobKey, &k.TaskType, &code, &k.Body}, func() error {
		if code != nil {
			k.Code = int(*code)
		}
		got[RequestKeyID{k.Route, k.Key}] = k
		k, code = RequestKey{}, nil
		return nil
	})
	return got, err
}

// answerRequestKeysSQL sets the answers of request keys (answer_request_keys.sql).
var answerRequestKeysSQL = sqlText("answer_request_keys", nil)

// AnswerRequestKeys sets the answer (Code, Body) of each of ks's rows.
func AnswerRequestKeys(ctx context.Context, q DB, ks []RequestKey) error {
	ids := make([]RequestKeyID, len(ks))
	codes, bodies := make([]*int32, len(ks)), make([][]byte, len(ks))
	for i, k := range ks {
		ids[i], codes[i], bodies[i] = RequestKeyID{k.Route, k.Key}, statusCode(k.Code), k.Body
	}
	routes, hks := requestKeyArrays(ids)
	_, err := q.Exec(ctx, answerRequestKeysSQL, PlanEach, routes, hks, codes, bodies)
	return err
}

// forgetRequestKeysSQL deletes the rows of request keys (forget_request_keys.sql).
var forgetRequestKeysSQL = sqlText("forget_request_keys", nil)

// ForgetRequestKeys deletes the rows of ids.
func ForgetRequestKeys(ctx context.Context, q DB, ids []RequestKeyID) error {
	routes, hks := requestKeyArrays(ids)
	_, err := q.Exec(ctx, forgetRequestKeysSQL, PlanEach, routes, hks)
	return err
}

// purgeRequestKeysSQL deletes a batch of old request keys (purge_request_keys.sql).
var purgeRequestKeysSQL = sqlText("purge_request_keys", nil)

// PurgeRequestKeys deletes at most limit rows created longer ago than olderThan and
// returns how many it deleted.
func PurgeRequestKeys(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, olderThan time.Duration, limit int) (int64, error) {
	tag, err := q.Exec(ctx, purgeRequestKeysSQL, olderThan.Milliseconds(), limit)
	return tag.RowsAffected(), err
}

// requestKeyJobSQL reads the task type an answered row names for a job
// (request_key_job.sql).
var requestKeyJobSQL = sqlText("request_key_job", nil)

// RequestKeyJob returns the task type of job jobKey as an answered row names it; ok is
// false when none does.
func RequestKeyJob(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, jobKey string) (taskType string, ok bool, err error) {
	err = q.QueryRow(ctx, requestKeyJobSQL, jobKey).Scan(&taskType)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", false, nil
	}
	return taskType, err == nil, err
}
