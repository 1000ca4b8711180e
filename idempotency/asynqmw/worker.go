package asynqmw

import (
	"context"
	"log/slog"
	"reflect"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/lock"
)

// Config configures a Worker. The zero value (or nil) gives the defaults.
type Config struct {
	// LockTTL is the Redis lock's TTL; the Worker's refresh loop refreshes every held
	// lock every LockTTL/3 while its handler runs. Default: 30s.
	LockTTL time.Duration

	// BusyBudget bounds how long a task may keep retrying as busy, counted from its
	// first enqueue (the idempotency.HeaderFirstEnqueued header) or, for a task without
	// the header (a plain asynq producer's), from when the ledger row's generation
	// started; past it, busy is a counted failure naming the owner, fence and age. It
	// bounds the retries of a task that finds Postgres unavailable too, counted from its
	// first enqueue (a task without the header is retried as long as that lasts).
	// Default: max(2 × the ledger's lease, 15m).
	BusyBudget time.Duration

	// LockKeyScoped takes the Redis lock also for jobs whose lock scope is their own key.
	// By default those skip it: the ledger's claim already lets one delivery at a time run
	// a key (the lease and the fence), so there the lock would only spare a concurrent
	// duplicate one claim statement, at the price of a SET and a release for every
	// delivery (each in a pipeline shared with the deliveries of the moment). Jobs with a wider scope (a customer, an account) always take it.
	LockKeyScoped bool

	// ScopeWaiters caps how many deliveries of one lock scope wait in this process for
	// the one that holds it, so that a hot scope cannot take every concurrency slot; one
	// more answers busy at once. Default: 8.
	ScopeWaiters int

	// ScopeWait bounds how long a delivery waits for its scope's lock (in line in this
	// process, or asking Redis while another process holds it) before it answers busy.
	// On the task's last attempt it waits as long as the delivery may run. Default: 2s.
	ScopeWait time.Duration

	// ScopeHandoffs and ScopeHold bound how many times, and for how long, the held lock
	// of a scope is handed from one delivery of this process to the next before the
	// process gives another process that asked for the scope its turn. Defaults: 256
	// and 1s.
	ScopeHandoffs int
	ScopeHold     time.Duration

	// Logger receives a line per notable outcome. Default: discard.
	Logger *slog.Logger

	// Redis, if set, writes each result to the task's asynq hash only while asynq still
	// holds the task (a compare-and-set script). Without it the middleware uses the task's
	// ResultWriter, which after Redis lost the task re-creates a hash holding only the
	// result, which asynq can never run or expire. Default: nil.
	Redis redis.Scripter

	// ObserveLock, if set, is called with each lock outcome (LockObtained, LockBusy,
	// LockLost, LockError) and the task type, for metrics. It must be fast and safe for
	// concurrent use.
	ObserveLock func(ev LockEvent, taskType string)

	// ObserveHandler, if set, is called once per delivery with the delivery's context
	// (its span, for a histogram's exemplar), the task type, its outcome (OutcomeCompleted,
	// OutcomeCached, OutcomeBusy, OutcomeError, OutcomeRejected) and how long it took. It
	// must be fast and safe for concurrent use.
	ObserveHandler func(ctx context.Context, taskType, outcome string, d time.Duration)

	// ObserveIntentDead, if set, is called when a delivery settles its own outbox intent
	// dead (see idempotency.Ledger.SettleIntent), with the task type and the reason
	// (idempotency.IntentDeadMismatch, IntentDeadFailed, IntentDeadNeedsAttention,
	// IntentDeadInvalid). It must be fast and safe for concurrent use.
	ObserveIntentDead func(taskType, reason string)

	// TracerProvider makes each delivery's span (see Leased): a consumer span "process
	// <task type>", the child of the traceparent in the task's headers. Default: the
	// global one (otel.GetTracerProvider), a no-op unless the program installed one.
	TracerProvider trace.TracerProvider
}

// LockEvent is a lock outcome, for counters (see Config.ObserveLock).
type LockEvent string

// Lock outcomes passed to Config.ObserveLock.
const (
	LockObtained LockEvent = "obtained" // the scope's lock was taken from Redis
	LockHanded   LockEvent = "handed"   // it was handed over by the delivery before, in this process
	LockWaited   LockEvent = "waited"   // another process held it: the delivery asked again
	LockBusy     LockEvent = "busy"     // it stayed held past the wait: retried soon
	LockLost     LockEvent = "lost"     // it expired or was taken while the handler ran
	LockError    LockEvent = "error"    // Redis failed; the ledger alone guarded the work
)

// Delivery outcomes passed to Config.ObserveHandler.
const (
	OutcomeCompleted = "completed" // the handler ran and its completion is durable
	OutcomeCached    = "cached"    // the key was already completed: answered from the ledger
	OutcomeBusy      = "busy"      // lock or lease busy: retried, not a failure
	OutcomeError     = "error"     // the handler or the ledger failed: retried or archived
	OutcomeRejected  = "rejected"  // bad payload, mismatch, terminal key: archived
)

// Worker composes the Redis lock and the ledger around asynq handlers, in the order
// decode → lock → claim → handler → complete → release → result. It is safe for
// concurrent use; build handlers for it with Leased and Transactional.
type Worker struct {
	ledger *idempotency.Ledger
	locker *lock.Locker
	cfg    Config
	log    *slog.Logger
	gate   *gate
	tracer trace.Tracer
	// batch sends the locks' commands (nil without a locker); results, the result
	// writes (nil when Config.Redis cannot pipeline: they go one by one): batch itself
	// when Config.Redis is the locker's client. combine: that client is one server's, so
	// a release and a result write go as one script call.
	batch, results *lock.Batcher
	combine        bool
}

// NewWorker returns a Worker using ledger and locker (locker may be nil: no Redis lock,
// the ledger alone guards the work).
func NewWorker(ledger *idempotency.Ledger, locker *lock.Locker, cfg *Config) *Worker {
	w := &Worker{ledger: ledger, locker: locker}
	if cfg != nil {
		w.cfg = *cfg
	}
	if w.cfg.LockTTL <= 0 {
		w.cfg.LockTTL = 30 * time.Second
	}
	if w.cfg.BusyBudget <= 0 {
		w.cfg.BusyBudget = max(2*ledger.Lease(), 15*time.Minute)
	}
	if w.cfg.ScopeWaiters <= 0 {
		w.cfg.ScopeWaiters = 8
	}
	if w.cfg.ScopeWait <= 0 {
		w.cfg.ScopeWait = 2 * time.Second
	}
	if w.cfg.ScopeHandoffs <= 0 {
		w.cfg.ScopeHandoffs = 256
	}
	if w.cfg.ScopeHold <= 0 {
		w.cfg.ScopeHold = time.Second
	}
	w.log = w.cfg.Logger
	if w.log == nil {
		w.log = slog.New(slog.DiscardHandler)
	}
	tp := w.cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	w.tracer = tp.Tracer(tracerName)
	w.gate = newGate(w)
	if locker != nil {
		w.batch = lock.NewBatcher(locker)
	}
	if c, ok := w.cfg.Redis.(lock.Client); ok {
		if locker != nil && sameClient(c, locker.Client()) {
			w.results = w.batch
			_, w.combine = c.(*redis.Client)
		} else {
			w.results = lock.NewBatcher(lock.New(c, nil))
		}
	}
	return w
}

// sameClient reports whether a and b are the same client.
func sameClient(a, b lock.Client) bool {
	return reflect.TypeOf(a).Comparable() && any(a) == any(b)
}

// Stop makes the deliveries waiting for a scope's lock, and every later one that needs a
// lock, answer busy at once (they are retried, by another process if this one is going
// away), and ends the handing over of held locks. Call it when the process begins to shut
// down, before asynq.Server.Shutdown.
func (w *Worker) Stop() { w.gate.stop() }

// Wait waits until the locks that deliveries left are given back to Redis (a delivery
// returns without waiting for that round trip: releases are queued and sent together).
// Call it after asynq.Server.Shutdown and before closing the Redis client, or the locks
// of the last deliveries stay held until their TTL ends.
func (w *Worker) Wait() {
	if w.batch != nil {
		w.batch.Wait()
		w.batch.Close()
	}
	if w.results != nil {
		w.results.Wait()
	}
}

// observeLock counts a lock outcome and adds it to the delivery's span (ctx's) as an
// "idemq.lock" event.
func (w *Worker) observeLock(ctx context.Context, ev LockEvent, taskType string) {
	lockSpanEvent(ctx, ev, nil)
	if w.cfg.ObserveLock != nil {
		w.cfg.ObserveLock(ev, taskType)
	}
}

// lockSpanEvent adds a lock outcome, and its cause when there is one, to ctx's span as an
// "idemq.lock" event.
func lockSpanEvent(ctx context.Context, ev LockEvent, cause error) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	attrs := []attribute.KeyValue{idempotency.AttrOutcome.String(string(ev))}
	if cause != nil {
		attrs = append(attrs, attribute.String("error.message", cause.Error()))
	}
	span.AddEvent("idemq.lock", trace.WithAttributes(attrs...))
}
