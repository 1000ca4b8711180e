package tracing_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/internal/tracing"
)

// With an OTLP endpoint in the environment, Setup exports spans there over HTTP/protobuf
// and flushes them on shutdown; with none, or with the SDK disabled, it installs nothing;
// an unknown protocol is refused by name.
func TestSetupFromTheEnvironment(t *testing.T) {
	var posts atomic.Int64
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/traces" && r.Header.Get("Content-Type") == "application/x-protobuf" {
			posts.Add(1)
		}
		w.WriteHeader(http.StatusOK)
	}))
	defer collector.Close()
	ctx := context.Background()

	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	if tracing.Enabled() {
		t.Fatal("enabled without an endpoint")
	}
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.URL)
	t.Setenv("OTEL_SDK_DISABLED", "true")
	if tracing.Enabled() {
		t.Fatal("enabled with OTEL_SDK_DISABLED=true")
	}
	t.Setenv("OTEL_SDK_DISABLED", "")
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
	if _, err := tracing.Setup(ctx, "idemq-test"); err == nil {
		t.Fatal("Setup accepted OTEL_EXPORTER_OTLP_PROTOCOL=http/json")
	}
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "")
	shutdown, err := tracing.Setup(ctx, "idemq-test")
	if err != nil {
		t.Fatal(err)
	}
	_, span := otel.Tracer("test").Start(ctx, "one")
	span.End()
	if err := shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if posts.Load() == 0 {
		t.Fatal("no span reached the OTLP endpoint")
	}
}

// A record logged with a context holding a span names its trace and span; one without
// does not.
func TestLogHandlerAddsTraceIDs(t *testing.T) {
	var b strings.Builder
	log := slog.New(tracing.LogHandler(slog.NewTextHandler(&b, nil))).With("cmd", "test")
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{0xab}, SpanID: trace.SpanID{0xcd}, TraceFlags: trace.FlagsSampled})
	log.InfoContext(trace.ContextWithSpanContext(context.Background(), sc), "traced")
	log.InfoContext(context.Background(), "untraced")
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], "trace_id="+sc.TraceID().String()) || !strings.Contains(lines[0], "span_id="+sc.SpanID().String()) ||
		!strings.Contains(lines[0], "cmd=test") || strings.Contains(lines[1], "trace_id") {
		t.Fatalf("log:\n%s\nwant trace_id and span_id on the first line only", b.String())
	}
}
