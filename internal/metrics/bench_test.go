package metrics

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"
)

// What one delivery observes: its duration (with an exemplar when its span is sampled),
// a lock outcome and a few ledger events.
func BenchmarkObserveHandler(b *testing.B) {
	m := New()
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		m.ObserveHandler(ctx, "wallet:debit", "completed", 3*time.Millisecond)
	}
}

func BenchmarkObserveHandlerSampled(b *testing.B) {
	m := New()
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{0x4b, 0xf9}, SpanID: trace.SpanID{1}, TraceFlags: trace.FlagsSampled})
	ctx := trace.ContextWithSpanContext(context.Background(), sc)
	b.ReportAllocs()
	for b.Loop() {
		m.ObserveHandler(ctx, "wallet:debit", "completed", 3*time.Millisecond)
	}
}

func BenchmarkCountLedgerEvent(b *testing.B) {
	m := New()
	b.ReportAllocs()
	for b.Loop() {
		m.ObserveLedger("completed", "wallet:debit")
	}
}

func BenchmarkCountLedgerEventParallel(b *testing.B) {
	m := New()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			m.ObserveLedger("completed", "wallet:debit")
		}
	})
}

func BenchmarkCountStep(b *testing.B) {
	m := New()
	b.ReportAllocs()
	for b.Loop() {
		m.ObserveStep("order:checkout", "receipt", "ran")
	}
}
