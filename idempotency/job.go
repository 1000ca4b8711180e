package idempotency

import "time"

// Job is a decoded payload, as the middleware (idempotency/asynqmw) sees it.
type Job interface {
	// Key is the idempotency key: the ledger key, the provider's idempotency key and the
	// TaskID of the first publish. See ValidateKey.
	Key() string
	// LockScope is the Redis lock's scope; it may be wider than the key ("" means the
	// key).
	LockScope() string
}

// MaxPayloadBytes is the largest payload a job may have; the outbox refuses a larger one
// at enqueue.
const MaxPayloadBytes = 64 << 10

// HeaderFirstEnqueued is the task header holding the time (RFC 3339, UTC) the job was
// first enqueued. It bounds how long a task may keep retrying as busy; it is not part of
// the payload's fingerprint.
const HeaderFirstEnqueued = "idemq-first-enqueued"

// HeaderTraceParent is the task header carrying a job's W3C traceparent: the outbox puts
// the one recorded with the intent on every publish of the job (the first and each
// republish), and asynqmw starts each delivery's span as its child.
const HeaderTraceParent = "traceparent"

// FirstEnqueued returns the time a task was first enqueued, from its headers; ok is false
// when the header is missing or unreadable.
func FirstEnqueued(headers map[string]string) (t time.Time, ok bool) {
	v, found := headers[HeaderFirstEnqueued]
	if !found {
		return time.Time{}, false
	}
	t, err := time.Parse(time.RFC3339Nano, v)
	return t, err == nil
}

// FirstEnqueuedHeader returns the headers that record t as a task's first enqueue.
func FirstEnqueuedHeader(t time.Time) map[string]string {
	return map[string]string{HeaderFirstEnqueued: t.UTC().Format(time.RFC3339Nano)}
}
