package config_test

import (
	"io"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/config"
)

// Every struct loads with its defaults (its bound tags parse and its defaults are within
// them) and lists its bounds in its usage.
func TestDefaultsLoadAndBoundTagsParse(t *testing.T) {
	for _, spec := range []any{&config.Migrate{}, &config.Enqueue{}, &config.Ledger{}, &config.Worker{}, &config.API{}, &config.Fakepay{}} {
		if err := config.Load(spec); err != nil {
			t.Errorf("%T with defaults: %v", spec, err)
		}
		if err := config.Usage(io.Discard, spec); err != nil {
			t.Errorf("%T usage: %v", spec, err)
		}
	}
	var b strings.Builder
	if err := config.Usage(&b, &config.Worker{}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"(at most 10000)", "(at least 500ms)"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("worker usage lacks %q:\n%s", want, b.String())
		}
	}
}

func TestLoadHoldsNumbersToTheirBounds(t *testing.T) {
	for _, tc := range []struct {
		spec     any
		env, val string
		want     string // "" when accepted
	}{
		{&config.Worker{}, "IDEMQ_CONCURRENCY", "10000", ""},
		{&config.Worker{}, "IDEMQ_CONCURRENCY", "10001", "IDEMQ_CONCURRENCY: must be at most 10000, got 10001"},
		{&config.Worker{}, "IDEMQ_CONCURRENCY", "0", "IDEMQ_CONCURRENCY: must be at least 1, got 0"},
		{&config.Worker{}, "IDEMQ_LEASE", "500ms", ""},
		{&config.Worker{}, "IDEMQ_LEASE", "1s", ""},
		{&config.Worker{}, "IDEMQ_LEASE", "499ms", "IDEMQ_LEASE: must be at least 500ms, got 499ms"},
		{&config.Worker{}, "IDEMQ_LOCK_TTL", "1ns", "IDEMQ_LOCK_TTL: must be at least 500ms, got 1ns"},
		{&config.Worker{}, "IDEMQ_LOCK_TTL", "-1s", "IDEMQ_LOCK_TTL: negative duration -1s"},
		{&config.Worker{}, "IDEMQ_SHUTDOWN_TIMEOUT", "0s", "IDEMQ_SHUTDOWN_TIMEOUT: must be greater than zero"},
		{&config.Worker{}, "IDEMQ_QUEUES", "default:3,low", ""},
		{&config.Worker{}, "IDEMQ_QUEUES", "default, default", `IDEMQ_QUEUES: queue "default" is listed more than once`},
		{&config.Worker{}, "IDEMQ_METRICS_ADDR", "", ""},
		{&config.Worker{}, "IDEMQ_METRICS_ADDR", "localhost:", `IDEMQ_METRICS_ADDR: "localhost:" is not host:port`},
		{&config.API{}, "IDEMQ_API_POOL_SIZE", "1", ""},
		{&config.API{}, "IDEMQ_API_POOL_SIZE", "-1", "IDEMQ_API_POOL_SIZE: must be at least 1, got -1"},
		{&config.API{}, "IDEMQ_API_POOL_SIZE", "x", `IDEMQ_API_POOL_SIZE="x": not a valid whole number`},
		{&config.API{}, "IDEMQ_API_POOL_SIZE", "2147483648", `IDEMQ_API_POOL_SIZE="2147483648": must be at most 2147483647`},
		{&config.API{}, "IDEMQ_HTTP_ADDR", "", "IDEMQ_HTTP_ADDR: must not be empty"},
		{&config.API{}, "IDEMQ_HTTP_ADDR", "[::1]:8080", ""},
		{&config.Fakepay{}, "IDEMQ_FAKEPAY_DELAY", "0s", ""},
		{&config.Ledger{}, "IDEMQ_LOG_LEVEL", "bogus", `IDEMQ_LOG_LEVEL: unknown level "bogus"`},
		{&config.Migrate{}, "IDEMQ_LOG_LEVEL", "warn", ""},
	} {
		t.Run(tc.env+"="+tc.val, func(t *testing.T) {
			t.Setenv(tc.env, tc.val)
			err := config.Load(tc.spec)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("got %v, want it accepted", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestLogLevel(t *testing.T) {
	if got := config.LogLevel(nil); got != "info" {
		t.Errorf("LogLevel(nil) = %q, want info", got)
	}
	if got := config.LogLevel(&config.Ledger{Log: config.Log{LogLevel: "warn"}}); got != "warn" {
		t.Errorf("LogLevel(ledger) = %q, want warn", got)
	}
	if got := config.LogLevel(&config.Worker{LogLevel: "debug"}); got != "debug" {
		t.Errorf("LogLevel(worker) = %q, want debug", got)
	}
}
