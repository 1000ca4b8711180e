// Package spantest checks, in tests, the spans of work several traced callers share (the
// library makes them with idempotency/internal/commit.StartSpan).
package spantest

import (
	"slices"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// CheckShared checks that spans hold spans named shared, each a root linked to two or
// more spans named one of members, each of which links back, and returns them. It fails
// the test when there is none.
func CheckShared(t testing.TB, spans []sdktrace.ReadOnlySpan, shared string, members ...string) []sdktrace.ReadOnlySpan {
	t.Helper()
	byID := map[trace.SpanID]sdktrace.ReadOnlySpan{}
	var found []sdktrace.ReadOnlySpan
	for _, s := range spans {
		switch {
		case s.Name() == shared:
			found = append(found, s)
		case slices.Contains(members, s.Name()):
			byID[s.SpanContext().SpanID()] = s
		}
	}
	if len(found) == 0 {
		t.Fatalf("concurrent callers made no %s span (%d member spans)", shared, len(byID))
	}
	for _, s := range found {
		if len(s.Links()) < 2 || s.Parent().IsValid() {
			t.Errorf("%s: %d links, parent %v; want 2 or more, and a root", shared, len(s.Links()), s.Parent())
		}
		for _, link := range s.Links() {
			member, ok := byID[link.SpanContext.SpanID()]
			if !ok {
				t.Errorf("%s links to %v, not one of %v", shared, link.SpanContext.SpanID(), members)
				continue
			}
			back := false
			for _, l := range member.Links() {
				back = back || l.SpanContext.SpanID() == s.SpanContext().SpanID()
			}
			if !back {
				t.Errorf("%s %v does not link back to its %s", member.Name(), member.SpanContext().SpanID(), shared)
			}
		}
	}
	t.Logf("%d %s spans; the first links %d members", len(found), shared, len(found[0].Links()))
	return found
}
