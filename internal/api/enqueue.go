package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/groupcommit"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/tasks"
)

// Enqueuer records jobs' intents inside the caller's transaction: *outbox.Client.
// EnqueueManyTx reports each spec's outcome at its index: an existing key with the same
// fingerprint as a duplicate, one with another fingerprint as an error wrapping
// idempotency.ErrMismatch; its last error is the statement's, which spoils tx. With
// selfPublish, the relays leave the new intents to the caller's publish for a while.
type Enqueuer interface {
	EnqueueManyTx(ctx context.Context, tx pgx.Tx, specs []outbox.Spec, selfPublish bool) ([]EnqueueResult, []error, error)
}

// IntentLookup is what GET /v1/jobs/{key} uses, when the Enqueuer offers it
// (*outbox.Client does), to report a job whose intent is recorded but which no
// worker has claimed yet. Intent returns an error wrapping idempotency.ErrNotFound for an
// unknown key.
type IntentLookup interface {
	Intent(ctx context.Context, key string) (*outbox.IntentInfo, error)
}

// publisher is the Enqueuer's optional publish of a committed intent, called after a
// commit; waker its optional wake-up of the relays, called instead when it cannot publish.
type (
	publisher interface {
		Publish(ctx context.Context, spec outbox.Spec) bool
	}
	waker interface{ Wake(ctx context.Context) }
)

// HeaderIdempotencyKey is the request header of the IETF httpapi idempotency-key draft.
const HeaderIdempotencyKey = "Idempotency-Key"

// HeaderReplayed is set to "true" on an answer replayed for a repeated Idempotency-Key.
const HeaderReplayed = "Idempotent-Replayed"

// acceptLockTimeout bounds how long a request waits for another one holding the same
// Idempotency-Key in its open transaction before it answers 409; a round of requests with
// Idempotency-Keys waits as long for any of them.
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

func (s *Server) postCheckout(w http.ResponseWriter, r *http.Request) {
	var c tasks.Checkout
	if !s.decode(w, r, &c) {
		return
	}
	if err := c.Validate(); err != nil { // names the email, never quotes it
		writeError(w, http.StatusUnprocessableEntity, err.Error())
		return
	}
	spec, err := tasks.CheckoutSpec(c)
	if err != nil {
		writeError(w, http.StatusUnprocessableEntity, err.Error())
		return
	}
	s.accept(w, r, "order_id", spec)
}

// decode checks that the body is declared JSON, reads at most MaxBodyBytes and decodes
// one JSON object strictly. A Content-Type other than application/json (parameters
// allowed) is 415: the types an HTML form can send (`curl -d` sends one of them too, so
// curl needs -H 'Content-Type: application/json') would let any web page post a job,
// while application/json makes a browser ask first with a CORS preflight, which the API
// never grants. A body larger than MaxBodyBytes is 413, before anything is read when its
// Content-Length says so (a client waiting on Expect: 100-continue gets no 100 Continue).
// Malformed JSON, a field sent twice and a case variant of a field's name ("REFERENCE",
// see idempotency.CheckFieldNames) are 400; an unknown field or a value of the wrong type is
// 422. Errors name the field, and quote a value at most 24 bytes long (tasks.TypeError):
// an amount_cents of 50,000 digits is not echoed back.
func (s *Server) decode(w http.ResponseWriter, r *http.Request, v any) bool {
	if mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err != nil || mt != "application/json" {
		w.Header().Set("Accept-Post", "application/json")
		writeError(w, http.StatusUnsupportedMediaType, "Content-Type: must be application/json")
		return false
	}
	if r.ContentLength > s.opts.MaxBodyBytes {
		writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body: larger than %d bytes", s.opts.MaxBodyBytes))
		return false
	}
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
	if err := idempotency.CheckFieldNames(body, v); err != nil {
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
		writeError(w, http.StatusUnprocessableEntity, tasks.TypeError(typeErr).Error())
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

// accept records the job's intent and, with an Idempotency-Key, the header's row, in a
// transaction shared with concurrent requests (sendAccepts), and answers 202 (new job),
// 200 (duplicate), a replay, 409 or 422 once that transaction committed.
func (s *Server) accept(w http.ResponseWriter, r *http.Request, keyField string, spec outbox.Spec) {
	hk, _, err := headerKey(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	ctx := r.Context()
	fp := idempotency.Fingerprint(spec.Type, spec.Payload)
	spec.TraceParent = idempotency.TraceParent(ctx) // the job's deliveries continue this request's trace

	req := &acceptReq{ctx: ctx, route: r.Pattern, hk: hk, keyField: keyField, fp: fp, spec: spec}
	err = s.accepts.Run(ctx, req)
	var stage *stageError
	switch {
	case err == nil && clientGone(ctx):
		return // nobody to answer: counted as 499; a retry gets the replay
	case errors.As(err, &stage) && idempotency.IsLockTimeout(err) && stage.stage == stageHeaders: // another request's open transaction holds the row past acceptLockTimeout
		writeError(w, http.StatusConflict, fmt.Sprintf("%s %q: a request with this key is still being accepted; retry shortly", HeaderIdempotencyKey, hk))
	case errors.As(err, &stage) && idempotency.IsLockTimeout(err):
		writeError(w, http.StatusConflict, fmt.Sprintf("%s: job %q is still being accepted by another request; retry shortly", keyField, spec.Key))
	case errors.Is(err, groupcommit.ErrCommitUnknown):
		s.log.WarnContext(ctx, "api: accept: commit outcome unknown", "method", r.Method, "path", r.URL.Path, "key", spec.Key, "err", err)
		unavailable(w, "accept: the database did not confirm the commit; retry with the same body and Idempotency-Key")
	case err != nil:
		s.internal(w, r, "accept", err)
	case req.failure != nil:
		s.internal(w, r, "record the job", req.failure)
	case req.refuseCode != 0:
		writeError(w, req.refuseCode, req.refusal)
	default:
		if req.replayed {
			w.Header().Set(HeaderReplayed, "true")
		}
		if req.isNew {
			s.publish(spec)
		}
		writeRaw(w, req.code, req.body)
	}
}

// publish hands a newly accepted job to asynq without making its request wait: at once
// when the Enqueuer can publish (*outbox.Client.Publish), else by waking the relays.
func (s *Server) publish(spec outbox.Spec) {
	ctx, cancel := context.WithTimeout(context.Background(), publishTimeout)
	switch p := s.deps.Enqueuer.(type) {
	case publisher:
		go func() {
			defer cancel()
			p.Publish(ctx, spec)
		}()
	case waker:
		go func() {
			defer cancel()
			p.Wake(ctx)
		}()
	default:
		cancel()
	}
}

// publishTimeout bounds the publish after a request's commit; a relay publishes what it
// did not.
const publishTimeout = 10 * time.Second

// EnqueueResult is what Enqueuer.EnqueueTx reports.
type EnqueueResult = outbox.EnqueueResult
