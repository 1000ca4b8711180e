// Package tracing turns OpenTelemetry tracing on from the standard environment variables,
// and only then: with no OTLP endpoint configured nothing is installed, so every span idemq
// starts is the API's no-op one and costs next to nothing.
package tracing

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// Enabled reports whether the environment asks for traces: an OTLP endpoint
// (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), OTEL_SDK_DISABLED
// not true and OTEL_TRACES_EXPORTER not none.
func Enabled() bool {
	if strings.EqualFold(os.Getenv("OTEL_SDK_DISABLED"), "true") || strings.EqualFold(os.Getenv("OTEL_TRACES_EXPORTER"), "none") {
		return false
	}
	return os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

// Setup installs, when Enabled, a global tracer provider that batches spans to the OTLP
// endpoint, over HTTP/protobuf or, with OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL=grpc, gRPC;
// the exporter reads its other OTEL_EXPORTER_OTLP_* variables itself, the sampler comes
// from OTEL_TRACES_SAMPLER (default parentbased_always_on) and the resource from
// OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (service.name defaults to service). It
// also installs the W3C trace-context and baggage propagators. The returned function
// flushes and stops the provider (a no-op when nothing was installed).
func Setup(ctx context.Context, service string) (func(context.Context) error, error) {
	if !Enabled() {
		return func(context.Context) error { return nil }, nil
	}
	var exp sdktrace.SpanExporter
	var err error
	switch p := protocol(); p {
	case "grpc":
		exp, err = otlptracegrpc.New(ctx)
	case "http/protobuf":
		exp, err = otlptracehttp.New(ctx)
	default:
		return nil, fmt.Errorf("OTEL_EXPORTER_OTLP_PROTOCOL=%q: idemq exports traces over http/protobuf or grpc", p)
	}
	if err != nil {
		return nil, fmt.Errorf("OpenTelemetry exporter: %w", err)
	}
	res, err := resource.Merge(resource.NewSchemaless(semconv.ServiceName(service)), resource.Environment())
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		return nil, fmt.Errorf("OpenTelemetry resource (OTEL_RESOURCE_ATTRIBUTES): %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	return tp.Shutdown, nil
}

// protocol is the OTLP protocol for traces the environment names (http/protobuf when none).
func protocol() string {
	for _, v := range []string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"} {
		if p := os.Getenv(v); p != "" {
			return p
		}
	}
	return "http/protobuf"
}

// Handler wraps h in an OpenTelemetry server span per request (HTTP semantic conventions,
// the caller's traceparent continued) when Enabled, and returns h itself otherwise.
func Handler(h http.Handler, operation string) http.Handler {
	if !Enabled() {
		return h
	}
	return otelhttp.NewHandler(h, operation)
}

// LogHandler wraps h so that a record logged with a context holding a valid span (the
// slog calls that take a context: InfoContext, WarnContext, …) carries trace_id and
// span_id, which a log pipeline can link to the trace.
func LogHandler(h slog.Handler) slog.Handler { return logHandler{h} }

type logHandler struct{ slog.Handler }

func (h logHandler) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		r.AddAttrs(slog.String("trace_id", sc.TraceID().String()), slog.String("span_id", sc.SpanID().String()))
	}
	return h.Handler.Handle(ctx, r)
}

func (h logHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return logHandler{h.Handler.WithAttrs(attrs)}
}

func (h logHandler) WithGroup(name string) slog.Handler { return logHandler{h.Handler.WithGroup(name)} }

// Client returns c with its transport wrapped in an OpenTelemetry client span per request
// (the traceparent sent along) when Enabled, and c itself otherwise.
func Client(c *http.Client) *http.Client {
	if !Enabled() {
		return c
	}
	traced := *c
	traced.Transport = otelhttp.NewTransport(c.Transport)
	return &traced
}
