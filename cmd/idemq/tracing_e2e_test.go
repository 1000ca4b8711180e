package main

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// span is what the receiver keeps of one exported span.
type span struct {
	service, name     string
	trace, id, parent string
	kind              tracepb.Span_SpanKind
	attrs             map[string]string
}

// otlpReceiver is a small OTLP/HTTP trace receiver: it decodes the protobuf requests
// idemq's exporters POST to /v1/traces.
type otlpReceiver struct {
	*httptest.Server
	mu    sync.Mutex
	spans []span
}

func newOTLPReceiver(t *testing.T) *otlpReceiver {
	r := &otlpReceiver{}
	r.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, err := io.ReadAll(req.Body)
		var msg coltracepb.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(body, &msg)
		}
		if req.URL.Path != "/v1/traces" || err != nil {
			t.Errorf("receiver: %s %s: %v", req.Method, req.URL.Path, err)
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, rs := range msg.ResourceSpans {
			service := ""
			for _, kv := range rs.Resource.GetAttributes() {
				if kv.Key == "service.name" {
					service = kv.Value.GetStringValue()
				}
			}
			for _, ss := range rs.ScopeSpans {
				for _, s := range ss.Spans {
					attrs := map[string]string{}
					for _, kv := range s.Attributes {
						attrs[kv.Key] = valueText(kv.Value)
					}
					r.spans = append(r.spans, span{service: service, name: s.Name, trace: hex.EncodeToString(s.TraceId),
						id: hex.EncodeToString(s.SpanId), parent: hex.EncodeToString(s.ParentSpanId), kind: s.Kind, attrs: attrs})
				}
			}
		}
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(r.Close)
	return r
}

// valueText is an attribute's value as text.
func valueText(v *commonpb.AnyValue) string {
	switch x := v.GetValue().(type) {
	case *commonpb.AnyValue_StringValue:
		return x.StringValue
	case *commonpb.AnyValue_IntValue:
		return fmt.Sprint(x.IntValue)
	case *commonpb.AnyValue_BoolValue:
		return fmt.Sprint(x.BoolValue)
	case *commonpb.AnyValue_DoubleValue:
		return fmt.Sprint(x.DoubleValue)
	}
	return v.String()
}

// trace returns the spans received so far of trace id.
func (r *otlpReceiver) trace(id string) []span {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []span
	for _, s := range r.spans {
		if s.trace == id {
			out = append(out, s)
		}
	}
	return out
}

// TestOneTraceFromTheRequestToEveryDelivery runs the real `idemq api`, fakepay and two
// workers exporting OTLP/HTTP to a receiver in the test. One charge is posted with a
// traceparent, then two duplicate deliveries of it are enqueued straight to asynq with the
// same traceparent (as a user re-enqueueing from that request would). One trace holds the
// POST, the publish, three delivery spans (one completed; the others cached, or busy first
// and cached when retried) and one provider call, which fakepay continues.
func TestOneTraceFromTheRequestToEveryDelivery(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the stack")
	}
	t.Parallel()
	recv := newOTLPReceiver(t)
	otel := []string{"OTEL_EXPORTER_OTLP_ENDPOINT=" + recv.URL, "OTEL_BSP_SCHEDULE_DELAY=100"}
	s := startStack(t, 2, otel, otel)
	port := testenv.FreePort(t)
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	startIdemq(t, "api", append([]string{"DATABASE_URL=" + s.dsn, "REDIS_URL=" + s.redisURL, fmt.Sprintf("IDEMQ_HTTP_ADDR=127.0.0.1:%d", port)}, otel...), "api")
	testenv.WaitHTTP(t, base+"/readyz", 30*time.Second)

	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	traceparent := "00-" + traceID + "-00f067aa0ba902b7-01"
	ctx := testenv.Context(t, 2*time.Minute)
	charge := tasks.Charge{OrderID: "o-traced", CustomerID: "c-1", AmountCents: 1250, Currency: "EUR"}
	req, _ := http.NewRequestWithContext(ctx, "POST", base+"/v1/charges",
		strings.NewReader(`{"order_id":"o-traced","customer_id":"c-1","amount_cents":1250,"currency":"EUR"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("traceparent", traceparent)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("POST: %d", resp.StatusCode)
	}
	s.waitCompleted(t, 1, 30*time.Second)
	dup, err := tasks.NewChargeTask(charge)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		s.enqueue(t, asynq.NewTaskWithHeaders(dup.Type(), dup.Payload(), map[string]string{idempotency.HeaderTraceParent: traceparent}),
			asynq.TaskID(fmt.Sprintf("charge:o-traced#dup%d", i)), asynq.Queue(tasks.Queue))
	}

	// Every delivery span, the provider's, and the answered duplicates' outcomes.
	var spans []span
	var deliveries, completed, cached int
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		spans = recv.trace(traceID)
		deliveries, completed, cached = 0, 0, 0
		for _, sp := range spans {
			if sp.name == "process "+tasks.TypeCharge {
				deliveries++
				switch sp.attrs["idemq.outcome"] {
				case "completed":
					completed++
				case "cached":
					cached++
				}
			}
		}
		if completed == 1 && cached == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 60 s the trace holds %d delivery spans (%d completed, %d cached); want 1 completed and 2 cached:\n%s",
				deliveries, completed, cached, describe(spans))
		}
	}
	count := func(ok func(span) bool) int {
		n := 0
		for _, sp := range spans {
			if ok(sp) {
				n++
			}
		}
		return n
	}
	server := count(func(sp span) bool {
		return sp.service == "idemq-api" && sp.kind == tracepb.Span_SPAN_KIND_SERVER && sp.name == "POST /v1/charges" && sp.parent == "00f067aa0ba902b7"
	})
	publish := count(func(sp span) bool { return sp.service == "idemq-api" && sp.kind == tracepb.Span_SPAN_KIND_PRODUCER })
	providerCalls := count(func(sp span) bool { return sp.service == "idemq-worker" && sp.kind == tracepb.Span_SPAN_KIND_CLIENT })
	providerServed := count(func(sp span) bool { return sp.service == "idemq-fakepay" && sp.kind == tracepb.Span_SPAN_KIND_SERVER })
	if server != 1 || publish != 1 || providerCalls != 1 || providerServed != 1 {
		t.Fatalf("trace %s: %d POST server spans under the caller's, %d publish, %d provider calls, %d served by the provider; want one each:\n%s",
			traceID, server, publish, providerCalls, providerServed, describe(spans))
	}
	fences := map[string]bool{}
	for _, sp := range spans {
		if sp.name == "process "+tasks.TypeCharge && sp.attrs["idemq.outcome"] != "busy" {
			fences[sp.attrs["idemq.fence"]] = true
		}
	}
	if len(fences) != 1 {
		t.Fatalf("the completed and cached deliveries name fences %v; want the one that did the work:\n%s", fences, describe(spans))
	}
	// The workers' duration histograms keep the trace id as an exemplar (OpenMetrics).
	exemplar := false
	for _, m := range s.metrics {
		req, _ := http.NewRequestWithContext(ctx, "GET", m, nil)
		req.Header.Set("Accept", "application/openmetrics-text; version=1.0.0")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		exemplar = exemplar || strings.Contains(string(body), `trace_id="`+traceID+`"`)
	}
	if !exemplar {
		t.Fatalf("no worker's idemq_handler_duration_seconds has an exemplar naming trace %s", traceID)
	}
	// The ledger row keeps the trace of the delivery that did the work.
	jreq, _ := http.NewRequestWithContext(ctx, "GET", base+"/v1/jobs/charge:o-traced", nil)
	jresp, err := http.DefaultClient.Do(jreq)
	if err != nil {
		t.Fatal(err)
	}
	var job struct {
		Status  string `json:"status"`
		TraceID string `json:"trace_id"`
	}
	err = json.NewDecoder(jresp.Body).Decode(&job)
	jresp.Body.Close()
	if err != nil || job.Status != "completed" || job.TraceID != traceID {
		t.Fatalf("GET /v1/jobs/charge:o-traced: %+v (%v); want completed, trace_id %s", job, err, traceID)
	}
	// The provider's log line for the call carries the trace's ids.
	if log := s.fakepay.tail(1 << 20); !strings.Contains(log, "trace_id="+traceID) {
		t.Fatalf("fakepay's log names no trace_id=%s:\n%s", traceID, log)
	}
	t.Logf("one trace, %d spans:\n%s", len(spans), describe(spans))
}

// describe lists spans as a tree, parents first, for failure messages and the log.
func describe(spans []span) string {
	children := map[string][]span{}
	ids := map[string]bool{}
	for _, sp := range spans {
		ids[sp.id] = true
	}
	var roots []span
	for _, sp := range spans {
		if ids[sp.parent] {
			children[sp.parent] = append(children[sp.parent], sp)
		} else {
			roots = append(roots, sp)
		}
	}
	var b strings.Builder
	var walk func(sp span, depth int)
	walk = func(sp span, depth int) {
		fmt.Fprintf(&b, "%s%s [%s, %s]", strings.Repeat("  ", depth), sp.name, sp.service, strings.TrimPrefix(sp.kind.String(), "SPAN_KIND_"))
		for _, k := range []string{"idemq.key", "idemq.outcome", "idemq.fence", "idemq.attempt"} {
			if v, ok := sp.attrs[k]; ok {
				fmt.Fprintf(&b, " %s=%s", k, v)
			}
		}
		b.WriteString("\n")
		for _, c := range children[sp.id] {
			walk(c, depth+1)
		}
	}
	for _, r := range roots {
		walk(r, 0)
	}
	return b.String()
}

// `idemq enqueue` with an OTLP endpoint and a TRACEPARENT from its caller: the command's
// span continues the caller's trace, the intent records it, and the publish is its child,
// so the job's deliveries join the caller's trace.
func TestEnqueueCommandContinuesTheCallersTrace(t *testing.T) {
	t.Parallel()
	recv := newOTLPReceiver(t)
	const traceID, parentID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
	dsn := testenv.PostgresURL(t)
	env := []string{"DATABASE_URL=" + dsn, "REDIS_URL=" + testenv.RedisURL(t),
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + recv.URL, "TRACEPARENT=00-" + traceID + "-" + parentID + "-01"}
	out, stderr, err := idemq(t, env, "enqueue", "debit", "--account-id", "a-1", "--amount-cents", "250", "--reference", "traced-cli")
	if err != nil || !strings.Contains(out, "debit:traced-cli\taccepted (published)") {
		t.Fatalf("enqueue: %v\n%s%s", err, out, stderr)
	}
	// The command flushes its spans before it exits.
	spans := recv.trace(traceID)
	var cmd, publish *span
	for i, sp := range spans {
		switch {
		case sp.name == "enqueue "+tasks.TypeDebit && sp.service == "idemq-enqueue":
			cmd = &spans[i]
		case sp.name == "publish "+tasks.TypeDebit && sp.kind == tracepb.Span_SPAN_KIND_PRODUCER:
			publish = &spans[i]
		}
	}
	if cmd == nil || publish == nil || cmd.parent != parentID || publish.parent != cmd.id || cmd.attrs["idemq.key"] != "debit:traced-cli" {
		t.Fatalf("trace %s: want the command's span under the caller's %s and the publish under it:\n%s", traceID, parentID, describe(spans))
	}
	var recorded string
	if err := testenv.Pool(t, dsn).QueryRow(testenv.Context(t, 10*time.Second),
		`SELECT trace_parent FROM job_intents WHERE idempotency_key = 'debit:traced-cli'`).Scan(&recorded); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(recorded, traceID) {
		t.Fatalf("the intent records traceparent %q, want one of trace %s", recorded, traceID)
	}
	t.Logf("%s", describe(spans))
}
