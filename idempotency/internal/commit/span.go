package commit

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// The span of work that several traced callers share: a transaction of many deliveries, a
// round of group-committed claims or completions. It belongs to no one caller's trace, so
// it is a root of its own, linked to each member's span, and each member's span is linked
// to it: a tracing UI leads from a delivery to the commit it waited for and from the
// commit to everyone in it.

// AttrMembers is how many callers a shared span's work carried (recording or not).
const AttrMembers = attribute.Key("idemq.members")

// SpanMembers are the recording spans of the callers whose work is shared. Its zero value
// holds none and allocates nothing until a recording span is added (tracing off: never).
type SpanMembers []trace.Span

// Add adds s, a caller's span, when it records (s may be nil).
func (m *SpanMembers) Add(s trace.Span) {
	if s != nil && s.IsRecording() {
		*m = append(*m, s)
	}
}

// StartSpan starts the span name of the work that members share, n callers in all, when
// tr is set and two or more members record; otherwise it returns nil. The caller ends it
// (EndSpan).
func StartSpan(tr trace.Tracer, name string, n int, members SpanMembers, attrs ...attribute.KeyValue) trace.Span {
	if tr == nil || len(members) < 2 {
		return nil
	}
	links := make([]trace.Link, len(members))
	for i, m := range members {
		links[i] = trace.Link{SpanContext: m.SpanContext()}
	}
	_, span := tr.Start(context.Background(), name, trace.WithNewRoot(), trace.WithLinks(links...),
		trace.WithAttributes(append(attrs, AttrMembers.Int(n))...))
	for _, m := range members {
		m.AddLink(trace.Link{SpanContext: span.SpanContext()})
	}
	return span
}

// EndSpan ends span, a shared span, with err's status when the shared work failed.
func EndSpan(span trace.Span, err error) {
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
