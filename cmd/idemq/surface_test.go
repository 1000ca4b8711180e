package main

import (
	"net"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/testenv"
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

// An address in use names the variable that chose it.
func TestPortInUseNamesTheVariable(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	addr := ln.Addr().String()
	env := []string{"DATABASE_URL=" + testenv.PostgresURL(t), "REDIS_URL=" + testenv.RedisURL(t)}
	for _, tc := range []struct{ cmd, name string }{{"fakepay", "IDEMQ_FAKEPAY_ADDR"}, {"api", "IDEMQ_HTTP_ADDR"}} {
		_, stderr, err := idemq(t, append(env, tc.name+"="+addr), tc.cmd)
		if err == nil || !strings.Contains(stderr, tc.name+"="+addr) || !strings.Contains(stderr, "address already in use") {
			t.Errorf("idemq %s on a port in use: %v, stderr %q; want it to name %s=%s", tc.cmd, err, stderr, tc.name, addr)
		}
	}
}
