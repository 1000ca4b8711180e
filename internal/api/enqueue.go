package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/tasks"
)

// Enqueuer records a job's intent inside the caller's transaction: *outbox.Client.
// EnqueueTx reports an existing key with the same fingerprint as a duplicate, and one
// with another fingerprint as an error wrapping idempotency.ErrMismatch.
type Enqueuer interface {
	EnqueueTx(ctx context.Context, tx pgx.Tx, spec outbox.Spec) (EnqueueResult, error)
}

// IntentLookup is what GET /v1/jobs/{key} uses, when the Enqueuer offers it
// (*outbox.Client does), to report a job whose intent is recorded but which no
// worker has claimed yet. Intent returns an error wrapping idempotency.ErrNotFound for an
// unknown key.
type IntentLookup interface {
	Intent(ctx context.Context, key string) (*outbox.IntentInfo, error)
}

// waker is the Enqueuer's optional wake-up of its relays, called after a commit.
type waker interface{ Wake(ctx context.Context) }

// HeaderIdempotencyKey is the request header of the IETF httpapi idempotency-key draft.
const HeaderIdempotencyKey = "Idempotency-Key"

// HeaderReplayed is set to "true" on an answer replayed for a repeated Idempotency-Key.
const HeaderReplayed = "Idempotent-Replayed"

// acceptLockTimeout bounds how long a request waits for another one holding the same
// Idempotency-Key in its open transaction before it answers 409.
const acceptLockTimeout = "200ms"

// jobResponse is the body of 202 (accepted) and 200 (duplicate).
type jobResponse struct {
	Key       string          `json:"key"`
	Type      string          `json:"type"`
	Status    string          `json:"status"`
	Intent    string          `json:"intent,omitempty"`
	Duplicate bool            `json:"duplicate"`
	Fence     int64           `json:"fence,omitempty"`
	Attempts  int             `json:"attempts,omitempty"`
	Result    json.RawMessage `json:"result,omitempty"`
	LastError string          `json:"last_error,omitempty"`
}

// StatusAccepted is a job's status while its intent is recorded and no worker has claimed
// it yet.
const StatusAccepted = "accepted"

func (s *Server) postCharge(w http.ResponseWriter, r *http.Request) {
	var c tasks.Charge
	if !s.decode(w, r, &c) {
		return
	}
	if err := c.Validate(); err != nil {
		writeError(w, http.StatusUnprocessableEntity, err.Error())
		return
	}
	spec, err := tasks.ChargeSpec(c)
	if err != nil {
		writeError(w, http.StatusUnprocessableEntity, err.Error())
		return
	}
	s.accept(w, r, "order_id", spec)
}

func (s *Server) postDebit(w http.ResponseWriter, r *http.Request) {
	var d tasks.Debit
	if !s.decode(w, r, &d) {
		return
	}
	if err := d.Validate(); err != nil {
		writeError(w, http.StatusUnprocessableEntity, err.Error())
		return
	}
	spec, err := tasks.DebitSpec(d)
	if err != nil {
		writeError(w, http.StatusUnprocessableEntity, err.Error())
		return
	}
	s.accept(w, r, "reference", spec)
}

// decode reads at most MaxBodyBytes (413 past that) and decodes one JSON object strictly
// (whatever the Content-Type says: `curl -d` sends a form type):
// malformed JSON, a field sent twice and a case variant of a field's name ("REFERENCE",
// see tasks.CheckFieldNames) are 400; an unknown field or a value of the wrong type is
// 422. Errors name the field.
func (s *Server) decode(w http.ResponseWriter, r *http.Request, v any) bool {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.opts.MaxBodyBytes))
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body: larger than %d bytes", tooBig.Limit))
		return false
	case err != nil:
		writeError(w, http.StatusBadRequest, "body: "+err.Error())
		return false
	}
	if err := tasks.CheckFieldNames(body, v); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return false
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	err = dec.Decode(v)
	if err == nil {
		if _, terr := dec.Token(); terr != io.EOF {
			writeError(w, http.StatusBadRequest, "body: malformed JSON: data after the object")
			return false
		}
		return true
	}
	var typeErr *json.UnmarshalTypeError
	switch {
	case errors.As(err, &typeErr) && typeErr.Field != "":
		writeError(w, http.StatusUnprocessableEntity, fmt.Sprintf("%s: must be a JSON %s, got %s", typeErr.Field, jsonKind(typeErr.Type.Kind().String()), typeErr.Value))
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		writeError(w, http.StatusUnprocessableEntity, strings.Trim(strings.TrimPrefix(err.Error(), "json: unknown field "), `"`)+": unknown field")
	case errors.As(err, &typeErr):
		writeError(w, http.StatusBadRequest, "body: must be a JSON object")
	case errors.Is(err, io.EOF):
		writeError(w, http.StatusBadRequest, "body: empty; send a JSON object")
	default:
		writeError(w, http.StatusBadRequest, "body: malformed JSON: "+err.Error())
	}
	return false
}

func jsonKind(goKind string) string {
	switch goKind {
	case "string":
		return "string"
	case "int", "int64", "int32", "uint", "uint64", "float64":
		return "whole number"
	}
	return goKind
}

// headerKey reads the Idempotency-Key header: absent is fine; present, it must be one
// value of 1 to 255 printable ASCII bytes, bare or as an RFC 8941 sf-string (in double
// quotes, `"` and `\` escaped by a backslash; see parseSFString).
func headerKey(r *http.Request) (key string, present bool, err error) {
	vals := r.Header.Values(HeaderIdempotencyKey)
	switch len(vals) {
	case 0:
		return "", false, nil
	case 1:
	default:
		return "", true, errors.New(HeaderIdempotencyKey + ": send one value, not several")
	}
	v := vals[0]
	if strings.HasPrefix(v, `"`) {
		if v, err = parseSFString(v); err != nil {
			return "", true, fmt.Errorf("%s: %w", HeaderIdempotencyKey, err)
		}
	}
	if v == "" {
		return "", true, errors.New(HeaderIdempotencyKey + ": empty")
	}
	if len(v) > 255 {
		return "", true, fmt.Errorf("%s: %d bytes; the limit is 255", HeaderIdempotencyKey, len(v))
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < 0x20 || c > 0x7e {
			return "", true, fmt.Errorf("%s: byte %d is not printable ASCII", HeaderIdempotencyKey, i)
		}
	}
	return v, true, nil
}

// parseSFString decodes s, which starts with a double quote, as an RFC 8941 sf-string
// (section 4.2.5): printable ASCII (0x20-0x7E) up to the closing quote, in which only `"`
// and `\` are escaped, by a backslash; nothing may follow. Go's own escapes are not
// escapes here: `"a\x41"` is refused, never read as the key aA.
func parseSFString(s string) (string, error) {
	var b strings.Builder
	for i := 1; i < len(s); i++ {
		switch c := s[i]; {
		case c == '\\':
			i++
			if i == len(s) {
				return "", errors.New("quoted key: no closing quote")
			}
			if s[i] != '"' && s[i] != '\\' {
				return "", fmt.Errorf(`quoted key: byte %d: only \" and \\ may be escaped`, i)
			}
			b.WriteByte(s[i])
		case c == '"':
			if i != len(s)-1 {
				return "", fmt.Errorf("quoted key: data after the closing quote at byte %d", i)
			}
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", fmt.Errorf("quoted key: byte %d is not printable ASCII", i)
		default:
			b.WriteByte(c)
		}
	}
	return "", errors.New("quoted key: no closing quote")
}

const (
	insertHeaderSQL = `INSERT INTO api_idempotency_keys (route, header_key, fingerprint, job_key, task_type)
VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING RETURNING true`
	getHeaderSQL = `SELECT fingerprint, status_code, response FROM api_idempotency_keys
WHERE route = $1 AND header_key = $2`
	answerHeaderSQL = `UPDATE api_idempotency_keys SET status_code = $3, response = $4
WHERE route = $1 AND header_key = $2`
)

// accept records the job's intent and, with an Idempotency-Key, the header's row, in one
// transaction, and answers 202 (new job), 200 (duplicate), a replay, 409 or 422.
func (s *Server) accept(w http.ResponseWriter, r *http.Request, keyField string, spec outbox.Spec) {
	hk, hasKey, err := headerKey(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	ctx := r.Context()
	route := r.Pattern
	fp := idempotency.Fingerprint(spec.Type, spec.Payload)

	// The ledger's row, for a duplicate's answer, is read before the transaction: reading
	// it from the pool while holding a connection in a transaction could exhaust the pool.
	rec, err := s.deps.Ledger.Get(ctx, spec.Key)
	if err != nil && !errors.Is(err, idempotency.ErrNotFound) {
		s.internal(w, r, "read the ledger", err)
		return
	}
	// A key the ledger knows with another payload (published without the outbox, say)
	// would only be archived as a mismatch by the worker: refuse it now.
	if rec != nil && rec.Fingerprint != nil && !bytes.Equal(rec.Fingerprint, fp) {
		writeError(w, http.StatusUnprocessableEntity, fmt.Sprintf("%s: job %q was already accepted with a different body", keyField, spec.Key))
		return
	}

	tx, err := s.deps.Pool.Begin(ctx)
	if err != nil {
		s.internal(w, r, "begin", err)
		return
	}
	defer func() {
		// Even past the request's deadline, but bounded: a Postgres that stopped answering
		// must not hold the handler past the server's write timeout.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
		defer cancel()
		tx.Rollback(ctx)
	}()
	lockTimeout := ""
	if hasKey {
		lockTimeout = acceptLockTimeout // a repeat waits this long for the first, then 409
	}
	if err := setTimeouts(ctx, tx, lockTimeout); err != nil {
		s.internal(w, r, "set timeouts", err)
		return
	}

	if hasKey {
		var inserted bool
		err := tx.QueryRow(ctx, insertHeaderSQL, route, hk, fp, spec.Key, spec.Type).Scan(&inserted)
		switch {
		case isLockTimeout(err):
			writeError(w, http.StatusConflict, fmt.Sprintf("%s %q: a request with this key is still being accepted; retry shortly", HeaderIdempotencyKey, hk))
			return
		case errors.Is(err, pgx.ErrNoRows):
			s.replay(w, r, tx, route, hk, fp)
			return
		case err != nil:
			s.internal(w, r, "record the Idempotency-Key", err)
			return
		}
		if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout TO DEFAULT"); err != nil {
			s.internal(w, r, "reset lock_timeout", err)
			return
		}
	}

	res, err := s.deps.Enqueuer.EnqueueTx(ctx, tx, spec)
	switch {
	case errors.Is(err, idempotency.ErrMismatch):
		writeError(w, http.StatusUnprocessableEntity, fmt.Sprintf("%s: job %q was already accepted with a different body", keyField, spec.Key))
		return
	case isLockTimeout(err):
		writeError(w, http.StatusConflict, fmt.Sprintf("%s: job %q is still being accepted by another request; retry shortly", keyField, spec.Key))
		return
	case err != nil:
		s.internal(w, r, "record the job", err)
		return
	}

	code, resp := http.StatusAccepted, jobResponse{Key: spec.Key, Type: spec.Type, Status: StatusAccepted, Intent: res.State}
	// A job the ledger knows is a duplicate even when its intent is new (its task was
	// published without the outbox, or the intent is gone): the worker answers it from the
	// ledger.
	if res.Duplicate || rec != nil {
		code, resp.Duplicate = http.StatusOK, true
		if rec != nil {
			resp.Status, resp.Fence, resp.Attempts, resp.Result, resp.LastError = rec.Status, rec.Fence, rec.Attempts, rec.Result, rec.LastError
		}
	}
	body, err := json.Marshal(resp)
	if err != nil {
		s.internal(w, r, "encode response", err)
		return
	}
	if hasKey {
		if _, err := tx.Exec(ctx, answerHeaderSQL, route, hk, code, body); err != nil {
			s.internal(w, r, "record the answer", err)
			return
		}
	}
	if s.holdAccept != nil {
		s.holdAccept(ctx)
	}
	if err := tx.Commit(ctx); err != nil {
		s.internal(w, r, "commit", err)
		return
	}
	if wk, ok := s.deps.Enqueuer.(waker); ok && !res.Duplicate {
		wk.Wake(ctx)
	}
	writeRaw(w, code, body)
}

// replay answers a repeated Idempotency-Key: the first answer when the body is the same,
// 422 when it is not.
func (s *Server) replay(w http.ResponseWriter, r *http.Request, tx pgx.Tx, route, hk string, fp []byte) {
	var (
		storedFP []byte
		code     *int
		body     []byte
	)
	if err := tx.QueryRow(r.Context(), getHeaderSQL, route, hk).Scan(&storedFP, &code, &body); err != nil {
		s.internal(w, r, "read the Idempotency-Key", err)
		return
	}
	if !bytes.Equal(storedFP, fp) {
		// Not naming the job the key made: it may be another caller's.
		writeError(w, http.StatusUnprocessableEntity, fmt.Sprintf("%s %q was used with a different body", HeaderIdempotencyKey, hk))
		return
	}
	if code == nil { // cannot happen: the row is answered in its own transaction
		writeError(w, http.StatusConflict, fmt.Sprintf("%s %q: a request with this key is still being accepted; retry shortly", HeaderIdempotencyKey, hk))
		return
	}
	w.Header().Set(HeaderReplayed, "true")
	writeRaw(w, *code, body)
}

// isLockTimeout reports SQLSTATE 55P03 (lock_not_available): another transaction holds
// the row past acceptLockTimeout.
func isLockTimeout(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "55P03"
}

// EnqueueResult is what Enqueuer.EnqueueTx reports.
type EnqueueResult = outbox.EnqueueResult
