package asynqmw_test

import (
	"context"
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// attrs is a span's attributes by key.
func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

// Three deliveries of one charge carrying the request's traceparent: three consumer spans,
// children of the request's span, the first "completed" with the handler's own span under
// it, the others "cached", all naming the fence of the run that did the work.
func TestDeliverySpansJoinTheRequestsTrace(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	f := newMW(t, 5*time.Second, &asynqmw.Config{TracerProvider: tp})
	f.chargeF = func(ctx context.Context, c tasks.Charge) (json.RawMessage, error) {
		_, call := tp.Tracer("user").Start(ctx, "provider call")
		call.End()
		return json.RawMessage(`{"charge":"` + c.OrderID + `"}`), nil
	}
	ctx := testenv.Context(t, 30*time.Second)
	reqCtx, request := tp.Tracer("test").Start(ctx, "POST /v1/charges")
	traceparent := idempotency.TraceParent(reqCtx)
	request.End()
	if traceparent == "" {
		t.Fatal("no traceparent for a sampled span")
	}
	plain := chargeTask(t, "o-traced", 100)
	task := asynq.NewTaskWithHeaders(plain.Type(), plain.Payload(), map[string]string{idempotency.HeaderTraceParent: traceparent})
	for range 3 {
		if err := f.charge.ProcessTask(ctx, task); err != nil {
			t.Fatal(err)
		}
	}

	var deliveries []sdktrace.ReadOnlySpan
	var call sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		switch s.Name() {
		case "process " + tasks.TypeCharge:
			deliveries = append(deliveries, s)
		case "provider call":
			call = s
		}
	}
	if len(deliveries) != 3 || call == nil {
		t.Fatalf("%d delivery spans and provider call %v; want 3 and one", len(deliveries), call != nil)
	}
	want := []string{asynqmw.OutcomeCompleted, asynqmw.OutcomeCached, asynqmw.OutcomeCached}
	fence := attrs(deliveries[0])["idemq.fence"].AsInt64()
	for i, s := range deliveries {
		a := attrs(s)
		if s.SpanKind() != trace.SpanKindConsumer || s.Parent().SpanID() != request.SpanContext().SpanID() ||
			s.SpanContext().TraceID() != request.SpanContext().TraceID() {
			t.Errorf("delivery %d: kind %v, parent %v, trace %v; want a consumer span under the request %v", i, s.SpanKind(),
				s.Parent().SpanID(), s.SpanContext().TraceID(), request.SpanContext())
		}
		if a["idemq.key"].AsString() != "charge:o-traced" || a["idemq.outcome"].AsString() != want[i] || a["idemq.fence"].AsInt64() != fence || fence == 0 ||
			a["messaging.system"].AsString() != "asynq" {
			t.Errorf("delivery %d: attributes %v; want key charge:o-traced, outcome %s, fence %d", i, s.Attributes(), want[i], fence)
		}
	}
	// The scope's lock (the customer's) is an event of each delivery.
	for i, d := range deliveries {
		var lockOutcome string
		for _, ev := range d.Events() {
			if ev.Name == "idemq.lock" {
				for _, kv := range ev.Attributes {
					if kv.Key == idempotency.AttrOutcome {
						lockOutcome = kv.Value.AsString()
					}
				}
			}
		}
		if lockOutcome != string(asynqmw.LockObtained) && lockOutcome != string(asynqmw.LockHanded) {
			t.Errorf("delivery %d: lock event %q, want obtained or handed", i, lockOutcome)
		}
	}
	if call.Parent().SpanID() != deliveries[0].SpanContext().SpanID() {
		t.Errorf("the handler's span is under %v, want the first delivery's %v", call.Parent().SpanID(), deliveries[0].SpanContext().SpanID())
	}
}

// A scope's lock lost while the handler runs (its Redis key deleted, as when Redis loses
// it) is an "idemq.lock" event "lost" with its cause on the delivery's span, and the
// delivery, cancelled, records an error.
func TestLockLossIsOnTheDeliverySpan(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	var lost atomic.Int64
	f := newMW(t, 5*time.Second, &asynqmw.Config{TracerProvider: tp, LockTTL: 600 * time.Millisecond,
		ObserveLock: func(ev asynqmw.LockEvent, _ string) {
			if ev == asynqmw.LockLost {
				lost.Add(1)
			}
		}})
	f.chargeF = func(ctx context.Context, c tasks.Charge) (json.RawMessage, error) {
		if err := f.rdb.Del(ctx, f.locker.RedisKey(c.LockScope())).Err(); err != nil {
			return nil, err
		}
		select { // the watchdog's next refresh (every 200 ms) finds the lock gone
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		case <-time.After(10 * time.Second):
			return json.RawMessage(`{}`), nil
		}
	}
	ctx := testenv.Context(t, 30*time.Second)
	dctx, parent := tp.Tracer("test").Start(ctx, "request")
	err := f.charge.ProcessTask(dctx, chargeTask(t, "o-lock-lost", 100))
	parent.End()
	if err == nil {
		t.Fatal("the delivery whose lock was lost completed")
	}
	var delivery sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "process "+tasks.TypeCharge {
			delivery = s
		}
	}
	if delivery == nil {
		t.Fatal("no delivery span")
	}
	var events []string
	for _, ev := range delivery.Events() {
		if ev.Name != "idemq.lock" {
			continue
		}
		e := ""
		for _, kv := range ev.Attributes {
			e += " " + string(kv.Key) + "=" + kv.Value.Emit()
		}
		events = append(events, strings.TrimSpace(e))
	}
	if len(events) != 2 || !strings.Contains(events[0], "idemq.outcome=obtained") ||
		!strings.Contains(events[1], "idemq.outcome=lost") || !strings.Contains(events[1], "error.message=") {
		t.Errorf("lock events %q; want obtained, then lost with its cause", events)
	}
	if lost.Load() != 1 {
		t.Errorf("ObserveLock counted %d losses, want 1", lost.Load())
	}
	t.Logf("delivery: %v; lock events %q", delivery.Status(), events)
}
