package lock

import (
	"math/rand/v2"
	"time"
)

// RetryStrategy decides whether and when Obtain tries again while the key is held by
// someone else. Implementations must be safe for concurrent use: one strategy may serve
// many Obtain calls at once. The strategies of this package keep no state between calls.
type RetryStrategy interface {
	// Backoff returns how long to wait before retry n (1 for the first retry), or false
	// when Obtain should give up with ErrNotObtained.
	Backoff(n int) (time.Duration, bool)
}

// RetryFunc adapts a function to a RetryStrategy.
type RetryFunc func(n int) (time.Duration, bool)

// Backoff calls f(n).
func (f RetryFunc) Backoff(n int) (time.Duration, bool) { return f(n) }

// NoRetry makes Obtain try once: a busy key gives ErrNotObtained at once.
func NoRetry() RetryStrategy { return noRetry{} }

type noRetry struct{}

func (noRetry) Backoff(int) (time.Duration, bool) { return 0, false }

// LinearBackoff retries up to maxRetries times, waiting delay before each retry.
// A negative delay counts as zero; maxRetries ≤ 0 means no retries.
func LinearBackoff(delay time.Duration, maxRetries int) RetryStrategy {
	return linear{delay: max(delay, 0), retries: maxRetries}
}

type linear struct {
	delay   time.Duration
	retries int
}

func (s linear) Backoff(n int) (time.Duration, bool) {
	if n < 1 || n > s.retries {
		return 0, false
	}
	return s.delay, true
}

// ExponentialBackoff retries up to maxRetries times. Before retry n it waits a random
// time in [d/2, d], where d = minDelay·2^(n-1) capped at maxDelay: the jitter keeps
// contending callers from retrying in step. A maxDelay below minDelay is raised to
// minDelay; negative delays count as zero; maxRetries ≤ 0 means no retries.
func ExponentialBackoff(minDelay, maxDelay time.Duration, maxRetries int) RetryStrategy {
	minDelay = max(minDelay, 0)
	return exponential{min: minDelay, max: max(maxDelay, minDelay), retries: maxRetries, rand: rand.Float64}
}

type exponential struct {
	min, max time.Duration
	retries  int
	rand     func() float64 // in [0, 1); safe for concurrent use
}

func (s exponential) Backoff(n int) (time.Duration, bool) {
	if n < 1 || n > s.retries {
		return 0, false
	}
	d := s.max
	// min·2^(n-1) without overflow: double until the cap is reached.
	if s.min < s.max {
		d = s.min
		for i := 1; i < n && d < s.max; i++ {
			if d == 0 {
				break
			}
			if d > s.max/2 {
				d = s.max
				break
			}
			d *= 2
		}
		d = min(d, s.max)
	}
	half := d / 2
	return half + time.Duration(s.rand()*float64(d-half)), true
}
