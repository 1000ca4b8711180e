package lock

import (
	"math"
	"testing"
	"time"
)

func TestNoRetry(t *testing.T) {
	for n := -1; n <= 3; n++ {
		if d, ok := NoRetry().Backoff(n); ok || d != 0 {
			t.Errorf("NoRetry().Backoff(%d) = %v, %v; want 0, false", n, d, ok)
		}
	}
}

func TestLinearBackoff(t *testing.T) {
	tests := []struct {
		name    string
		delay   time.Duration
		retries int
		n       int
		want    time.Duration
		wantOK  bool
	}{
		{"first", 10 * time.Millisecond, 3, 1, 10 * time.Millisecond, true},
		{"last", 10 * time.Millisecond, 3, 3, 10 * time.Millisecond, true},
		{"past the count", 10 * time.Millisecond, 3, 4, 0, false},
		{"zero retries", 10 * time.Millisecond, 0, 1, 0, false},
		{"negative retries", 10 * time.Millisecond, -5, 1, 0, false},
		{"negative delay", -time.Second, 2, 1, 0, true},
		{"n below one", 10 * time.Millisecond, 3, 0, 0, false},
	}
	for _, tc := range tests {
		got, ok := LinearBackoff(tc.delay, tc.retries).Backoff(tc.n)
		if got != tc.want || ok != tc.wantOK {
			t.Errorf("%s: Backoff(%d) = %v, %v; want %v, %v", tc.name, tc.n, got, ok, tc.want, tc.wantOK)
		}
	}
}

func TestExponentialBackoffBounds(t *testing.T) {
	ms := time.Millisecond
	tests := []struct {
		name          string
		min, max      time.Duration
		retries, n    int
		wantLo, wantH time.Duration // the un-jittered d is wantH; jitter gives [d/2, d]
		wantOK        bool
	}{
		{"first retry", 10 * ms, time.Second, 10, 1, 5 * ms, 10 * ms, true},
		{"doubles", 10 * ms, time.Second, 10, 2, 10 * ms, 20 * ms, true},
		{"doubles again", 10 * ms, time.Second, 10, 4, 40 * ms, 80 * ms, true},
		{"capped", 10 * ms, 100 * ms, 10, 10, 50 * ms, 100 * ms, true},
		{"huge n does not overflow", 10 * ms, time.Hour, math.MaxInt, math.MaxInt - 1, 30 * time.Minute, time.Hour, true},
		{"huge max does not overflow", time.Second, math.MaxInt64, 200, 200, math.MaxInt64 / 2, math.MaxInt64, true},
		{"max below min is raised", 50 * ms, 10 * ms, 3, 3, 25 * ms, 50 * ms, true},
		{"zero min stays zero", 0, time.Second, 5, 5, 0, 0, true},
		{"negative min is zero", -ms, 0, 5, 1, 0, 0, true},
		{"past the count", 10 * ms, time.Second, 3, 4, 0, 0, false},
		{"no retries", 10 * ms, time.Second, 0, 1, 0, 0, false},
		{"n below one", 10 * ms, time.Second, 3, 0, 0, 0, false},
	}
	for _, tc := range tests {
		for _, r := range []float64{0, 0.5, math.Nextafter(1, 0)} {
			s := ExponentialBackoff(tc.min, tc.max, tc.retries).(exponential)
			s.rand = func() float64 { return r }
			got, ok := s.Backoff(tc.n)
			if ok != tc.wantOK {
				t.Errorf("%s (rand %v): Backoff(%d) ok = %v, want %v", tc.name, r, tc.n, ok, tc.wantOK)
				continue
			}
			if got < tc.wantLo || got > tc.wantH {
				t.Errorf("%s (rand %v): Backoff(%d) = %v, want within [%v, %v]", tc.name, r, tc.n, got, tc.wantLo, tc.wantH)
			}
			if r == 0 && got != tc.wantLo {
				t.Errorf("%s: Backoff(%d) with rand 0 = %v, want the lower bound %v", tc.name, tc.n, got, tc.wantLo)
			}
		}
	}
}

func TestExponentialBackoffJitter(t *testing.T) {
	s := ExponentialBackoff(8*time.Millisecond, time.Second, 5)
	seen := map[time.Duration]bool{}
	for range 1000 {
		d, ok := s.Backoff(3) // d = 32ms, jittered in [16ms, 32ms]
		if !ok || d < 16*time.Millisecond || d > 32*time.Millisecond {
			t.Fatalf("Backoff(3) = %v, %v; want within [16ms, 32ms]", d, ok)
		}
		seen[d] = true
	}
	if len(seen) < 100 {
		t.Errorf("1000 draws gave %d distinct delays, want jitter", len(seen))
	}
}

func TestRetryFunc(t *testing.T) {
	f := RetryFunc(func(n int) (time.Duration, bool) { return time.Duration(n), n < 3 })
	if d, ok := f.Backoff(2); d != 2 || !ok {
		t.Errorf("Backoff(2) = %v, %v; want 2ns, true", d, ok)
	}
	if _, ok := f.Backoff(3); ok {
		t.Errorf("Backoff(3) ok = true, want false")
	}
}
