// Package sharedspan makes the span of work that several traced callers share: a
// transaction of many deliveries, a round of group-committed claims or completions. It
// belongs to no one caller's trace, so it is a root of its own, linked to each member's
// span, and each member's span is linked to it: a tracing UI leads from a delivery to the
// commit it waited for and from the commit to everyone in it.
package sharedspan

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// AttrMembers is how many callers a shared span's work carried (recording or not).
const AttrMembers = attribute.Key("idemq.members")

// Start starts the span name of the work that members' spans share, n callers in all
// (members are the traced ones), when tr is set and two or more of members record;
// otherwise it returns nil. The caller ends it.
func Start(tr trace.Tracer, name string, n int, members []trace.Span, attrs ...attribute.KeyValue) trace.Span {
	if tr == nil {
		return nil
	}
	var links []trace.Link
	for _, m := range members {
		if m.IsRecording() {
			links = append(links, trace.Link{SpanContext: m.SpanContext()})
		}
	}
	if len(links) < 2 {
		return nil
	}
	_, span := tr.Start(context.Background(), name, trace.WithNewRoot(), trace.WithLinks(links...),
		trace.WithAttributes(append(attrs, AttrMembers.Int(n))...))
	for _, m := range members {
		if m.IsRecording() {
			m.AddLink(trace.Link{SpanContext: span.SpanContext()})
		}
	}
	return span
}

// End ends span, a shared span, with err's status when the shared work failed.
func End(span trace.Span, err error) {
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
