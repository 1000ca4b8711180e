package main

import (
	"strings"
	"testing"
)

// A REDIS_URL that is not one says what one looks like.
func TestBadRedisURLShowsAnExample(t *testing.T) {
	t.Parallel()
	for _, url := range []string{"foo", "127.0.0.1:6379"} {
		_, stderr, err := idemq(t, []string{"REDIS_URL=" + url}, "worker")
		if err == nil || !strings.Contains(stderr, "REDIS_URL") || !strings.Contains(stderr, "redis://localhost:6379/0") {
			t.Errorf("REDIS_URL=%s: %v, stderr %q; want it to show redis://localhost:6379/0", url, err, stderr)
		}
	}
}
