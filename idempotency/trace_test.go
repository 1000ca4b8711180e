package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/spantest"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/internal/tracing"
)

// tree renders the spans recorded under root as "name outcome=… fence=…" lines, indented
// by depth, children in start order.
func tree(rec *tracetest.SpanRecorder, root trace.SpanContext) string {
	kids := map[trace.SpanID][]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		kids[s.Parent().SpanID()] = append(kids[s.Parent().SpanID()], s)
	}
	var b strings.Builder
	var walk func(id trace.SpanID, depth int)
	walk = func(id trace.SpanID, depth int) {
		for _, s := range kids[id] {
			b.WriteString(strings.Repeat("  ", depth) + s.Name())
			for _, kv := range s.Attributes() {
				if k := string(kv.Key); k == "idemq.outcome" || k == "idemq.fence" || k == "idemq.attempt" {
					b.WriteString(" " + strings.TrimPrefix(k, "idemq.") + "=" + kv.Value.Emit())
				}
			}
			b.WriteString("\n")
			walk(s.SpanContext().SpanID(), depth+1)
		}
	}
	walk(root.SpanID(), 0)
	return b.String()
}

// The span trees Do makes under a delivery's span: a fresh key, a duplicate, a takeover
// after a crashed claim, and a stale owner whose lease was taken from it.
func TestDoSpanTrees(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	lease := 600 * time.Millisecond
	l, _ := newLedger(t, &idempotency.Config{Lease: lease, TracerProvider: tp})
	ctx := testenv.Context(t, time.Minute)
	ok := func(context.Context) (json.RawMessage, error) { return json.RawMessage(`{}`), nil }
	// delivery runs Do under a span of its own and returns that span's tree.
	delivery := func(key string, fn func(context.Context) (json.RawMessage, error)) (string, error) {
		dctx, span := tp.Tracer("test").Start(ctx, "delivery")
		_, err := l.Do(dctx, req(key), fn)
		span.End()
		return tree(rec, span.SpanContext()), err
	}
	check := func(name, got, want string) {
		t.Helper()
		if got != want {
			t.Errorf("%s: span tree\n%s\nwant\n%s", name, got, want)
		}
	}

	got, err := delivery("fresh", ok)
	if err != nil {
		t.Fatal(err)
	}
	fence := strings.Fields(strings.SplitN(got, "\n", 2)[0])[2] // "fence=N"
	check("fresh key", got, strings.ReplaceAll("idemq.claim outcome=claimed FENCE attempt=1\nidemq.handler\nidemq.complete FENCE outcome=completed\n", "FENCE", fence))
	t.Logf("fresh key:\n%s", got)

	got, err = delivery("fresh", ok)
	if err != nil {
		t.Fatal(err)
	}
	check("duplicate", got, "idemq.claim outcome=cached "+fence+"\n")
	t.Logf("duplicate:\n%s", got)

	// A transactional job: one span for its claim, work and completion, which commit
	// together; a duplicate sees the result.
	txWork := func(_ context.Context, tx pgx.Tx) (json.RawMessage, error) { return json.RawMessage(`{}`), nil }
	dctx, span := tp.Tracer("test").Start(ctx, "delivery")
	if _, err := l.DoTx(dctx, req("tx"), txWork); err != nil {
		t.Fatal(err)
	}
	span.End()
	got = tree(rec, span.SpanContext())
	txFence := strings.Fields(got)[2]
	check("transactional", got, "idemq.tx outcome=claimed "+txFence+" attempt=1\n")
	t.Logf("transactional:\n%s", got)
	dctx, span = tp.Tracer("test").Start(ctx, "delivery")
	if _, err := l.DoTx(dctx, req("tx"), txWork); err != nil {
		t.Fatal(err)
	}
	span.End()
	check("transactional duplicate", tree(rec, span.SpanContext()), "idemq.tx outcome=cached "+txFence+"\n")

	// A claim whose worker crashed: its lease runs out, the next delivery takes over.
	if _, err := l.Claim(ctx, req("crashed")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(lease + 100*time.Millisecond)
	got, err = delivery("crashed", ok)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(got, "idemq.claim outcome=takeover") || !strings.Contains(got, "attempt=2\nidemq.handler\nidemq.complete") ||
		!strings.HasSuffix(got, "outcome=completed\n") {
		t.Errorf("takeover: span tree\n%s\nwant claim outcome=takeover attempt=2, handler, complete outcome=completed", got)
	}
	t.Logf("takeover after a crashed claim:\n%s", got)

	// A stale owner: an operator ends its lease while its handler runs, another delivery
	// takes the key over, and the stale owner's heartbeat finds it gone.
	taken := make(chan struct{})
	got, err = delivery("stale", func(hctx context.Context) (json.RawMessage, error) {
		if err := l.Release(ctx, "stale"); err != nil {
			return nil, err
		}
		if _, err := l.Do(ctx, req("stale"), ok); err != nil {
			return nil, err
		}
		close(taken)
		<-hctx.Done() // the next heartbeat (lease/3) finds the lease taken
		return nil, context.Cause(hctx)
	})
	<-taken
	if !errors.Is(err, idempotency.ErrLeaseLost) {
		t.Fatalf("stale owner: %v, want ErrLeaseLost", err)
	}
	if !strings.HasPrefix(got, "idemq.claim outcome=claimed") || !strings.HasSuffix(got, "outcome=lease_lost\n") {
		t.Errorf("stale owner: span tree\n%s\nwant claim outcome=claimed, handler, complete outcome=lease_lost", got)
	}
	t.Logf("stale owner:\n%s", got)
}

// Each Step and StepTx call is an idemq.step span under the handler's, with the step's
// name, its key and its outcome, and the step's own work (fn's spans) under it: on the
// first delivery the charge and the record run and the receipt fails (its error on the
// span); on the next the charge and the record come from their records, with the fence
// that recorded them, and the receipt runs.
func TestStepSpans(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	l, _ := newLedger(t, &idempotency.Config{TracerProvider: tp})
	ctx := testenv.Context(t, time.Minute)
	errDown := errors.New("provider down")
	var deliveries atomic.Int64
	handler := func(hctx context.Context) (json.RawMessage, error) {
		n := deliveries.Add(1)
		_, err := idempotency.Step(hctx, "charge", func(ctx context.Context, stepKey string) (string, error) {
			_, span := tp.Tracer("test").Start(ctx, "provider call")
			span.End()
			return "ch_1", nil
		})
		if err != nil {
			return nil, err
		}
		if _, err := idempotency.StepTx(hctx, "record", func(ctx context.Context, tx pgx.Tx) (int, error) { return 1, nil }); err != nil {
			return nil, err
		}
		_, err = idempotency.Step(hctx, "receipt", func(ctx context.Context, stepKey string) (int, error) {
			if n == 1 {
				return 0, errDown
			}
			return 1, nil
		})
		return nil, err
	}
	delivery := func() (trace.SpanContext, error) {
		dctx, span := tp.Tracer("test").Start(ctx, "delivery")
		_, err := l.Do(dctx, req("checkout:1"), handler)
		span.End()
		return span.SpanContext(), err
	}
	first, err := delivery()
	if !errors.Is(err, errDown) {
		t.Fatalf("first delivery: %v, want %v", err, errDown)
	}
	second, err := delivery()
	if err != nil {
		t.Fatalf("second delivery: %v", err)
	}
	f1 := strings.Fields(tree(rec, first))[2] // "fence=N"
	f2 := strings.Fields(tree(rec, second))[2]
	if f1 == f2 {
		t.Fatalf("both deliveries claimed with %s", f1)
	}
	for _, tc := range []struct {
		name string
		sc   trace.SpanContext
		want string
	}{
		{"first delivery", first, "idemq.claim outcome=claimed F1 attempt=1\nidemq.handler\n" +
			"  idemq.step outcome=ran F1\n    provider call\n" +
			"  idemq.step outcome=ran F1\n" +
			"  idemq.step outcome=error F1\n" +
			"idemq.complete F1 outcome=failed\n"},
		{"second delivery", second, "idemq.claim outcome=takeover F2 attempt=2\nidemq.handler\n" +
			"  idemq.step outcome=cached F1\n" +
			"  idemq.step outcome=cached F1\n" +
			"  idemq.step outcome=ran F2\n" +
			"idemq.complete F2 outcome=completed\n"},
	} {
		want := strings.NewReplacer("F1", f1, "F2", f2).Replace(tc.want)
		if got := tree(rec, tc.sc); got != want {
			t.Errorf("%s: span tree\n%s\nwant\n%s", tc.name, got, want)
		}
	}

	// Each step span's name and key; the failed one's error.
	var steps []string
	for _, s := range rec.Ended() {
		if s.Name() != "idemq.step" {
			continue
		}
		a := map[string]string{}
		for _, kv := range s.Attributes() {
			a[string(kv.Key)] = kv.Value.Emit()
		}
		steps = append(steps, fmt.Sprintf("%s %s %s %s %q", a["idemq.key"], a["idemq.step"], a["idemq.step_key"], s.Status().Code, s.Status().Description))
	}
	want := []string{
		`checkout:1 charge checkout:1#s/charge Unset ""`,
		`checkout:1 record checkout:1#s/record Unset ""`,
		`checkout:1 receipt checkout:1#s/receipt Error "provider down"`,
		`checkout:1 charge checkout:1#s/charge Unset ""`,
		`checkout:1 record checkout:1#s/record Unset ""`,
		`checkout:1 receipt checkout:1#s/receipt Unset ""`,
	}
	if strings.Join(steps, "\n") != strings.Join(want, "\n") {
		t.Errorf("idemq.step spans (key, step, step key, status):\n%s\nwant\n%s", strings.Join(steps, "\n"), strings.Join(want, "\n"))
	}
}

// Transactional deliveries that share a transaction: each one's idemq.tx span and the
// transaction's idemq.shared_tx span are linked both ways.
func TestSharedTransactionSpan(t *testing.T) {
	t.Parallel()
	rec, tp, l := tracedLedger(t)
	traces := runConcurrently(t, tp, 12, "shared", func(ctx context.Context, key string) error {
		_, err := l.DoTx(ctx, req(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			_, err := tx.Exec(ctx, "SELECT pg_sleep(0.01)")
			return json.RawMessage(`{}`), err
		})
		return err
	})
	spantest.CheckShared(t, rec.Ended(), "idemq.shared_tx", "idemq.tx")
	checkRowTraces(t, l, traces)
}

// Claims and completions group-committed in one round of the leased committer share a
// span of their own, idemq.commit, linked both ways with the members' idemq.claim and
// idemq.complete spans; each ledger row keeps its delivery's trace id.
func TestGroupCommitSpan(t *testing.T) {
	t.Parallel()
	rec, tp, l := tracedLedger(t)
	traces := runConcurrently(t, tp, 16, "grouped", func(ctx context.Context, key string) error {
		_, err := l.Do(ctx, req(key), func(context.Context) (json.RawMessage, error) { return json.RawMessage(`{}`), nil })
		return err
	})
	rounds := spantest.CheckShared(t, rec.Ended(), "idemq.commit", "idemq.claim", "idemq.complete")
	for _, s := range rounds {
		var claims, completions, members int64
		for _, kv := range s.Attributes() {
			switch kv.Key {
			case "idemq.claims":
				claims = kv.Value.AsInt64()
			case "idemq.completions":
				completions = kv.Value.AsInt64()
			case "idemq.members":
				members = kv.Value.AsInt64()
			}
		}
		if claims+completions != members || members < int64(len(s.Links())) {
			t.Errorf("round: %d claims + %d completions, %d members, %d links", claims, completions, members, len(s.Links()))
		}
	}
	checkRowTraces(t, l, traces)
}

// tracedLedger returns a ledger with one committer (so that concurrent calls share its
// rounds) whose spans rec records.
func tracedLedger(t *testing.T) (*tracetest.SpanRecorder, trace.TracerProvider, *idempotency.Ledger) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	l, _ := newLedger(t, &idempotency.Config{Committers: 1, TracerProvider: tp})
	return rec, tp, l
}

// runConcurrently runs n deliveries at once, each fn(ctx, "<prefix>-i") under a span of
// its own trace, and returns each key's trace id.
func runConcurrently(t *testing.T, tp trace.TracerProvider, n int, prefix string, fn func(ctx context.Context, key string) error) map[string]string {
	t.Helper()
	ctx := testenv.Context(t, time.Minute)
	traces := make(map[string]string, n)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := fmt.Sprintf("%s-%d", prefix, i)
			dctx, span := tp.Tracer("test").Start(ctx, "delivery")
			defer span.End()
			mu.Lock()
			traces[key] = span.SpanContext().TraceID().String()
			mu.Unlock()
			if err := fn(dctx, key); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	return traces
}

// checkRowTraces checks that each key's ledger row keeps the trace id traces gives.
func checkRowTraces(t *testing.T, l *idempotency.Ledger, traces map[string]string) {
	t.Helper()
	for key, want := range traces {
		rec, err := l.Get(testenv.Context(t, 10*time.Second), key)
		if err != nil {
			t.Fatal(err)
		}
		if rec.TraceID != want {
			t.Errorf("%s: the ledger row keeps trace %q, want %q (its delivery's)", key, rec.TraceID, want)
		}
	}
}

// The ledger's lines about a traced delivery (here a takeover, then a stale owner's lost
// lease) carry the delivery's trace id.
func TestLedgerLinesCarryTheTrace(t *testing.T) {
	t.Parallel()
	var logs testenv.LogBuffer
	tp := sdktrace.NewTracerProvider()
	lease := 600 * time.Millisecond
	l, _ := newLedger(t, &idempotency.Config{Lease: lease, TracerProvider: tp,
		Logger: slog.New(tracing.LogHandler(slog.NewTextHandler(&logs, nil)))})
	ctx := testenv.Context(t, time.Minute)
	if _, err := l.Claim(ctx, req("crashed")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(lease + 100*time.Millisecond)
	dctx, span := tp.Tracer("test").Start(ctx, "delivery")
	if _, err := l.Do(dctx, req("crashed"), func(context.Context) (json.RawMessage, error) { return json.RawMessage(`{}`), nil }); err != nil {
		t.Fatal(err)
	}
	span.End()
	want := "trace_id=" + span.SpanContext().TraceID().String()
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, "took over an expired lease") && !strings.Contains(line, want) {
			t.Fatalf("takeover line without %s: %s", want, line)
		}
	}
	if !strings.Contains(logs.String(), "took over an expired lease") {
		t.Fatalf("no takeover line:\n%s", logs.String())
	}
}
