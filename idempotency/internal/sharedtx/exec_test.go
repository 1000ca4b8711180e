package sharedtx

import (
	"testing"
	"time"
)

func TestTimesFitAndSlow(t *testing.T) {
	var h times
	if got := h.fit(5*time.Millisecond, 64); got != 64 {
		t.Fatalf("fit with no measurement = %d, want the most, 64", got)
	}
	for range 200 {
		h.record(time.Millisecond)
	}
	if got := h.fit(5*time.Millisecond, 64); got < 4 || got > 5 {
		t.Fatalf("fit at ~1ms a turn in 5ms = %d, want 4..5 (never rounded up)", got)
	}
	if got := h.fit(5*time.Millisecond, 3); got > 3 {
		t.Fatalf("fit = %d past the most, 3", got)
	}
	for range 200 {
		h.record(time.Second)
	}
	if got := h.fit(5*time.Millisecond, 64); got != 2 {
		t.Fatalf("fit at ~1s a turn = %d, want the floor of 2", got)
	}
	if got := h.fit(5*time.Millisecond, 1); got != 1 {
		t.Fatalf("fit with most 1 = %d, want 1", got)
	}
	if !h.slow(time.Millisecond) || h.slow(time.Hour) {
		t.Fatalf("slow at ~1s: against 1ms %v (want true), against 1h %v (want false)", h.slow(time.Millisecond), h.slow(time.Hour))
	}
}

// TestWithLinesLeavesTheQueueBatchAlone: the lines' deliveries join a batch in a copy,
// so the queue's batch, which Done frees key by key, still holds exactly its leads.
func TestWithLinesLeavesTheQueueBatchAlone(t *testing.T) {
	e := New(Config{MaxBatch: 64})
	lead := func(key, scope string) *member { return &member{d: Delivery{Key: key, Scope: scope}, scope: scope} }
	leads := make([]*member, 0, 16) // room to grow in place, as the queue's batches often have
	leads = append(leads, lead("x-1", "s1"), lead("y-2", "s2"), lead("z-3", "s3"))
	for _, s := range []string{"s1", "s2", "s3"} {
		e.scopes[s] = &line{waiting: []*member{lead("a-"+s, s), lead("b-"+s, s)}}
	}
	want := []string{"x-1", "y-2", "z-3"}
	got := e.withLines(leads, 64)
	for i, m := range leads {
		if m.d.Key != want[i] {
			t.Fatalf("the queue's batch now holds %s at %d, want %s: its leads' keys would stay in flight", m.d.Key, i, want[i])
		}
	}
	if len(got) != 9 || got[0].d.Key != "a-s1" || got[8].d.Key != "z-3" {
		t.Fatalf("batch with lines: %d members, first %s, last %s; want 9, a-s1 … z-3", len(got), got[0].d.Key, got[len(got)-1].d.Key)
	}
	for s, ln := range e.scopes {
		if len(ln.waiting) != 0 {
			t.Fatalf("scope %s: %d still waiting, want its line in the batch", s, len(ln.waiting))
		}
	}
}
