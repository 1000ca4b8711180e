package asynqmw

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/internal/asynqkeys"
	"github.com/idemq/idemq/idempotency/internal/testhook"
	"github.com/idemq/idemq/lock"
)

// MaxResultWriteBytes caps what the middleware writes to a task's ResultWriter (what the
// asynqmon dashboard shows); the ledger keeps the whole result.
const MaxResultWriteBytes = 64 << 10

// ErrLockBusy reports that another delivery holds the Redis lock of the task's scope. Like
// ErrBusy, it is not a failure: IsFailure returns false and RetryDelay retries soon.
var ErrLockBusy = errors.New("asynqmw: lock busy")

// Leased returns the handler of a task type whose effect is external (a provider call, an
// email): fn runs under a heartbeated ledger lease, with the key and fence in its context
// (FromContext) to pass downstream as the provider's idempotency key. decode must decode
// strictly and validate; its error archives the task with the reason.
func Leased[T idempotency.Job](w *Worker, taskType string, decode func([]byte) (T, error), fn func(ctx context.Context, job T) (json.RawMessage, error)) asynq.Handler {
	return &handler[T]{w: w, taskType: taskType, decode: decode, run: func(ctx context.Context, req idempotency.Request, job T, effectDone func()) (idempotency.Result, error) {
		return w.ledger.Do(ctx, req, func(ctx context.Context) (json.RawMessage, error) {
			// The effect is over when fn returns (or panics): the scope's next delivery
			// may start its own while this one's completion commits.
			defer effectDone()
			return permanentIfSkip(testhook.Effect(ctx, false, func() (json.RawMessage, error) { return fn(ctx, job) }))
		})
	}}
}

// Transactional returns the handler of a task type whose effect lives in the ledger's
// Postgres: fn's writes and the completion commit in one transaction. fn must not do
// external I/O. decode as for Leased.
func Transactional[T idempotency.Job](w *Worker, taskType string, decode func([]byte) (T, error), fn func(ctx context.Context, tx pgx.Tx, job T) (json.RawMessage, error)) asynq.Handler {
	return &handler[T]{w: w, taskType: taskType, decode: decode, tx: true, run: func(ctx context.Context, req idempotency.Request, job T, _ func()) (idempotency.Result, error) {
		return w.ledger.DoTx(ctx, req, func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			return permanentIfSkip(testhook.Effect(ctx, true, func() (json.RawMessage, error) { return fn(ctx, tx, job) }))
		})
	}}
}

// TransactionalSQL is Transactional for handlers that write through database/sql (GORM,
// sqlx, ent, bun, sqlc): fn's writes through tx and the completion commit in one
// transaction (idempotency.Ledger.DoSQLTx), taken from the ledger's Config.SQL. Each
// delivery runs in a transaction of its own; the deliveries of one scope take turns
// through the scope's lock, one at a time. fn must not do external I/O, nor commit or
// roll back tx. decode as for Leased.
func TransactionalSQL[T idempotency.Job](w *Worker, taskType string, decode func([]byte) (T, error), fn func(ctx context.Context, tx *sql.Tx, job T) (json.RawMessage, error)) asynq.Handler {
	return &handler[T]{w: w, taskType: taskType, decode: decode, run: func(ctx context.Context, req idempotency.Request, job T, _ func()) (idempotency.Result, error) {
		return w.ledger.DoSQLTx(ctx, req, func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
			return permanentIfSkip(testhook.Effect(ctx, true, func() (json.RawMessage, error) { return fn(ctx, tx, job) }))
		})
	}}
}

// permanentIfSkip makes a handler's asynq.SkipRetry a permanent failure in the ledger.
func permanentIfSkip(out json.RawMessage, err error) (json.RawMessage, error) {
	if errors.Is(err, asynq.SkipRetry) && !idempotency.IsPermanent(err) {
		return out, idempotency.Permanent(err)
	}
	return out, err
}

type handler[T idempotency.Job] struct {
	w        *Worker
	taskType string
	decode   func([]byte) (T, error)
	// run does the work; a leased run calls effectDone when the handler's effect is over,
	// before its completion commits.
	run func(ctx context.Context, req idempotency.Request, job T, effectDone func()) (idempotency.Result, error)
	// tx: the work runs in the ledger's transaction (DoTx), which takes the deliveries of
	// one scope in turn (Request.Scope): they ride the scope's turn together.
	tx bool
}

var _ asynq.Handler = (*handler[idempotency.Job])(nil)

// ProcessTask handles one delivery, in a span of its own (see startSpan).
func (h *handler[T]) ProcessTask(ctx context.Context, t *asynq.Task) error {
	start := time.Now()
	ctx, span := h.w.startSpan(ctx, h.taskType, t)
	outcome, err := h.process(ctx, t)
	endSpan(span, outcome, err)
	if h.w.cfg.ObserveHandler != nil {
		h.w.cfg.ObserveHandler(ctx, h.taskType, outcome, time.Since(start))
	}
	return err
}

func (h *handler[T]) process(ctx context.Context, t *asynq.Task) (outcome string, _ error) {
	taskID, _ := asynq.GetTaskID(ctx)
	if t.Type() != h.taskType {
		return h.refuse(ctx, t, taskID, fmt.Errorf("%s: handler got a task of type %q: %w", h.taskType, t.Type(), asynq.SkipRetry))
	}
	job, err := h.decode(t.Payload())
	if err != nil {
		return h.refuse(ctx, t, taskID, fmt.Errorf("%s: bad payload: %v: %w", h.taskType, err, asynq.SkipRetry))
	}
	key := job.Key()
	if err := idempotency.ValidateKey(key); err != nil {
		return h.refuse(ctx, t, taskID, fmt.Errorf("%s: bad payload: key %.64q: %v: %w", h.taskType, key, err, asynq.SkipRetry))
	}
	span := trace.SpanFromContext(ctx)
	if span.IsRecording() {
		span.SetAttributes(idempotency.AttrKey.String(key))
	}
	canonical, err := json.Marshal(job)
	if err != nil {
		return h.refuse(ctx, t, taskID, fmt.Errorf("%s: bad payload: key %s: encode: %v: %w", h.taskType, key, err, asynq.SkipRetry))
	}
	scope := job.LockScope()
	if scope == "" {
		scope = key
	}
	runCtx := ctx
	// leave ends the delivery's turn in its scope, with the write of its result (nil:
	// none), which goes with the lock's release when the lock goes back to Redis.
	leave := h.w.sendResult
	// effectDone ends the scope's turn as soon as a leased handler returns: a wider scope
	// keeps effects apart, and this one's is over; its completion, a fenced write to the
	// ledger, then commits while the scope's next delivery claims and runs (their commits
	// share a round). A key-scoped lock is held until the completion is durable, or a
	// duplicate would find the lease still held and answer busy.
	effectDone := func() {}
	lineScope := "" // the ledger's Request.Scope
	if h.w.locker != nil && (scope != key || h.w.cfg.LockKeyScoped) {
		// On the last attempt a busy answer would archive the task: wait for the lock as
		// long as the delivery may run.
		hold, err := h.w.gate.enter(ctx, scope, h.taskType, scope == key, lastAttempt(ctx), h.tx)
		switch {
		case errors.Is(err, lock.ErrNotObtained):
			h.w.observeLock(ctx, LockBusy, h.taskType)
			return OutcomeBusy, fmt.Errorf("%s: key %s: lock %s held by another delivery: %w", h.taskType, key, scope, ErrLockBusy)
		case hold == nil:
			return OutcomeError, err
		case err != nil:
			// Redis is a fast path: without it the ledger still guards the work.
			h.log(ctx, key).WarnContext(ctx, "lock unavailable; relying on the ledger", "scope", scope, "err", err)
		}
		runCtx, leave = hold.ctx, hold.leaveWith
		defer hold.leave()
		if scope != key {
			effectDone = hold.leave
		}
		if h.tx {
			lineScope = scope
		}
	}

	req := idempotency.Request{Key: key, TaskType: h.taskType, Fingerprint: idempotency.Fingerprint(h.taskType, canonical), Scope: lineScope,
		TaskID: taskID}
	if own, ok := idempotency.IntentKey(taskID); ok && own == key {
		req.PayloadSum = idempotency.PayloadSum(t.Type(), t.Payload())
	}
	if d, ok := ctx.Deadline(); ok {
		req.Deadline = d
	}
	for {
		res, err := h.run(runCtx, req, job, effectDone)
		if err == nil {
			// The work is durable: the scope's next delivery need not wait for the
			// result's write to asynq, which goes with the lock's release (or on its own,
			// with the other deliveries' writes of the moment); leave returns once it is
			// written.
			rw := h.newResultWrite(ctx, t, res.Result, key)
			leave(rw)
			if hook := testhook.From(ctx); hook != nil {
				hook.Answered(ctx, res)
			}
			if rw == nil {
				h.writeResult(ctx, t, res.Result, key)
			}
			if span.IsRecording() { // a cached answer names the run that did the work
				span.SetAttributes(idempotency.AttrFence.Int64(res.Fence))
			}
			if res.Cached {
				// A cached answer settles nothing by itself: the intent of this task, when
				// it is an outbox intent's own, is done now.
				if _, err := h.w.ledger.SettleIntent(ctx, req, false, ""); err != nil {
					return OutcomeError, fmt.Errorf("%s: key %s: %w", h.taskType, key, err)
				}
				return OutcomeCached, nil
			}
			return OutcomeCompleted, nil
		}
		var busy *idempotency.BusyError
		if !errors.As(err, &busy) {
			if age, known := taskAge(t); known && age > h.w.cfg.BusyBudget && unavailable(err) {
				return OutcomeError, &UnavailableTooLongError{Key: key, Age: age, Err: err}
			}
			outcome, err := h.mapError(err, key)
			if reason := deadReason(err); reason != "" {
				if serr := h.settleDead(ctx, req, reason, err); serr != nil {
					return OutcomeError, serr
				}
			}
			return outcome, err
		}
		if age, known := busyAge(t, busy); known && age > h.w.cfg.BusyBudget {
			h.w.ledger.Record(idempotency.HistoryEvent{Key: key, Generation: busy.Generation, Kind: idempotency.HistoryBusy,
				TaskType: h.taskType, TaskID: req.TaskID, Fence: busy.Fence,
				Detail: fmt.Sprintf("busy for %s, past the busy budget %s: held by owner %s", age.Round(time.Second), h.w.cfg.BusyBudget, busy.Owner)})
			return OutcomeError, &BusyTooLongError{Key: key, Owner: busy.Owner, Fence: busy.Fence, Age: age}
		}
		if !lastAttempt(ctx) {
			return OutcomeBusy, err
		}
		// On the last attempt a busy answer would archive the task: wait for the lease to
		// end instead (bounded by the delivery's deadline), then claim again.
		wait := time.Until(busy.Until) + 50*time.Millisecond
		h.log(ctx, key).InfoContext(ctx, "last attempt finds the key busy; waiting for the lease to end", "owner", busy.Owner, "fence", busy.Fence, "wait", wait)
		select {
		case <-runCtx.Done():
			return OutcomeError, fmt.Errorf("%s: key %s: waiting for lease of fence %d: %w", h.taskType, key, busy.Fence, context.Cause(runCtx))
		case <-time.After(max(wait, 50*time.Millisecond)):
		}
	}
}

// log returns the logger of a line about the delivery of key: the worker's, with the
// task type, the key and, when ctx has it, the attempt. It is built for each line, so
// that a delivery that writes none pays nothing for it.
func (h *handler[T]) log(ctx context.Context, key string) *slog.Logger {
	log := h.w.log.With("task_type", h.taskType, "key", key)
	if n, ok := asynq.GetRetryCount(ctx); ok {
		log = log.With("attempt", n)
	}
	return log
}

// refuse archives a delivery the worker cannot run (a payload it cannot decode, a bad
// key), and settles its outbox intent dead with the reason when the task is an intent's
// own by its TaskID: its key is then the TaskID's (the payload may not name one).
func (h *handler[T]) refuse(ctx context.Context, t *asynq.Task, taskID string, err error) (string, error) {
	key, ok := idempotency.IntentKey(taskID)
	if !ok {
		return OutcomeRejected, err
	}
	req := idempotency.Request{Key: key, TaskType: t.Type(), TaskID: taskID, PayloadSum: idempotency.PayloadSum(t.Type(), t.Payload())}
	if serr := h.settleDead(ctx, req, idempotency.IntentDeadInvalid, err); serr != nil {
		return OutcomeError, serr
	}
	return OutcomeRejected, err
}

// settleDead settles req's outbox intent dead (when the task is its own) with cause, an
// error that archives the task. When that write fails, the error it returns is retried
// instead: the next delivery meets the same answer and settles the intent then.
func (h *handler[T]) settleDead(ctx context.Context, req idempotency.Request, reason string, cause error) error {
	settled, err := h.w.ledger.SettleIntent(ctx, req, true, reason+": "+cause.Error())
	if err != nil {
		return fmt.Errorf("%s: key %s: archiving (%v) waits for its intent: %w", h.taskType, req.Key, cause, err)
	}
	if settled {
		h.w.log.WarnContext(ctx, "accepted job's task refused; its intent is dead", "task_type", h.taskType, "key", req.Key,
			"task_id", req.TaskID, "reason", reason, "err", cause)
		if h.w.cfg.ObserveIntentDead != nil {
			h.w.cfg.ObserveIntentDead(h.taskType, reason)
		}
	}
	return nil
}

// deadReason is the reason an answer of the ledger refuses the job for good (the task is
// archived, and its own outbox intent settled dead), "" when it does not.
func deadReason(err error) string {
	switch {
	case errors.Is(err, idempotency.ErrMismatch):
		return idempotency.IntentDeadMismatch
	case errors.Is(err, idempotency.ErrFailed):
		return idempotency.IntentDeadFailed
	case errors.Is(err, idempotency.ErrNeedsAttention):
		return idempotency.IntentDeadNeedsAttention
	case errors.Is(err, idempotency.ErrInvalidKey), errors.Is(err, idempotency.ErrInvalidRequest):
		return idempotency.IntentDeadInvalid
	}
	return ""
}

func (h *handler[T]) mapError(err error, key string) (string, error) {
	switch {
	case deadReason(err) != "": // the ledger refused the job for good
		return OutcomeRejected, fmt.Errorf("%s: key %s: %w: %w", h.taskType, key, err, asynq.SkipRetry)
	case errors.Is(err, asynq.SkipRetry):
		return OutcomeError, fmt.Errorf("%s: key %s: %w", h.taskType, key, err)
	case idempotency.IsPermanent(err):
		return OutcomeError, fmt.Errorf("%s: key %s: %w: %w", h.taskType, key, err, asynq.SkipRetry)
	}
	return OutcomeError, fmt.Errorf("%s: key %s: %w", h.taskType, key, err)
}

// writeResult shows the result in asynq (the dashboard) after the durable completion,
// while the delivery is still live, when it fits; errors are only logged. It is the
// path of a result that newResultWrite does not send through the results Batcher.
func (h *handler[T]) writeResult(ctx context.Context, t *asynq.Task, result json.RawMessage, key string) {
	w := t.ResultWriter()
	if w == nil || len(result) == 0 || ctx.Err() != nil {
		return
	}
	if len(result) > MaxResultWriteBytes {
		h.log(ctx, key).DebugContext(ctx, "result too large for the task's result", "bytes", len(result))
		return
	}
	queue, _ := asynq.GetQueueName(ctx)
	switch {
	case h.w.cfg.Redis != nil && queue != "":
		n, err := writeResultScript.Run(ctx, h.w.cfg.Redis, []string{asynqkeys.Task(queue, w.TaskID())}, []byte(result)).Int()
		if err != nil {
			h.log(ctx, key).DebugContext(ctx, "write task result", "err", err)
		} else if n < 0 {
			h.log(ctx, key).InfoContext(ctx, "task gone from Redis; result kept in the ledger only", "task_id", w.TaskID())
		}
	default:
		if _, err := w.Write(result); err != nil {
			h.log(ctx, key).DebugContext(ctx, "write task result", "err", err)
		}
	}
}

// ArchiveUnknown hands mux the tasks it has a handler for and archives every other task
// at once, with the reason (asynq.SkipRetry) naming the type, the queue, the known types
// and the fix: asynq's own answer, "handler not found", counts as a failure and is
// retried up to the task's MaxRetry (asynq's default 25, over days). Serve it in place of
// mux: srv.Start(ArchiveUnknown(mux, "payment:charge", "wallet:debit")).
//
// A worker so served owns the queues it serves: a task of another binary's type put on
// one of them is archived, not left for that binary (asynq dequeues whatever is on a
// queue, and a handler cannot hand a task back untouched; a retry would spend the task's
// retries and delay it). Give each binary's task types a queue of their own.
func ArchiveUnknown(mux *asynq.ServeMux, known ...string) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		if _, pattern := mux.Handler(t); pattern == "" {
			where := ""
			if q, ok := asynq.GetQueueName(ctx); ok {
				where = fmt.Sprintf(" on queue %.64q", q)
			}
			return fmt.Errorf("unknown task type %.64q%s: this worker handles %s and archives any other type on the queues it serves; "+
				"give other task types a queue of their own (asynq.Queue), served only by the worker that runs them: %w",
				t.Type(), where, strings.Join(known, ", "), asynq.SkipRetry)
		}
		return mux.ProcessTask(ctx, t)
	})
}
