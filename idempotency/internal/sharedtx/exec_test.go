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
