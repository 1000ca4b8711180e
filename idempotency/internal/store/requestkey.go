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

// insertRequestKeysSQL records many request keys in one statement, each with its answer,
// and returns those it recorded.
const insertRequestKeysSQL = `INSERT INTO api_idempotency_keys (route, header_key, fingerprint, job_key, task_type, status_code, response)
SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[], $5::text[], $6::int[], $7::bytea[])
ON CONFLICT DO NOTHING RETURNING route, header_key`

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

const readRequestKeysSQL = `SELECT k.route, k.header_key, k.fingerprint, k.job_key, k.task_type, k.status_code, k.response
FROM api_idempotency_keys k JOIN unnest($1::text[], $2::text[]) AS r(route, header_key) USING (route, header_key)`

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

const answerRequestKeysSQL = `UPDATE api_idempotency_keys k SET status_code = a.code, response = a.body
FROM unnest($1::text[], $2::text[], $3::int[], $4::bytea[]) AS a(route, header_key, code, body)
WHERE k.route = a.route AND k.header_key = a.header_key`

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

const forgetRequestKeysSQL = `DELETE FROM api_idempotency_keys k
USING unnest($1::text[], $2::text[]) AS r(route, header_key)
WHERE k.route = r.route AND k.header_key = r.header_key`

// ForgetRequestKeys deletes the rows of ids.
func ForgetRequestKeys(ctx context.Context, q DB, ids []RequestKeyID) error {
	routes, hks := requestKeyArrays(ids)
	_, err := q.Exec(ctx, forgetRequestKeysSQL, PlanEach, routes, hks)
	return err
}

// purgeRequestKeysSQL deletes at most $2 rows older than $1 milliseconds.
const purgeRequestKeysSQL = `DELETE FROM api_idempotency_keys WHERE ctid = ANY(ARRAY(
	SELECT ctid FROM api_idempotency_keys WHERE created_at < now() - $1 * interval '1 millisecond' LIMIT $2))`

// PurgeRequestKeys deletes at most limit rows created longer ago than olderThan and
// returns how many it deleted.
func PurgeRequestKeys(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, olderThan time.Duration, limit int) (int64, error) {
	tag, err := q.Exec(ctx, purgeRequestKeysSQL, olderThan.Milliseconds(), limit)
	return tag.RowsAffected(), err
}

const requestKeyJobSQL = `SELECT task_type FROM api_idempotency_keys WHERE job_key = $1 AND status_code IS NOT NULL LIMIT 1`

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
