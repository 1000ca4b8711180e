// Package testenv is the one way idemq's tests reach real servers.
//
// Postgres and Redis give a test an isolated view of the shared servers (a fresh migrated
// schema, a Redis database of its own). StartPostgres and StartRedis start private servers
// from the installed binaries on a free loopback port, for tests that must kill, stop or
// pause them. When a shared server does not answer, the test fails with a message saying
// how to start one: it never skips.
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/localserver"
)

// DefaultDatabaseURL and DefaultRedisURL are used when neither TEST_DATABASE_URL /
// DATABASE_URL nor TEST_REDIS_URL / REDIS_URL is set.
const (
	DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	DefaultRedisURL    = "redis://127.0.0.1:6379/0"
)

// setupTimeout bounds what testenv does around a test (create, migrate and drop a schema
// or a database, open a pool, run a helper statement). It is not a measure of anything: on
// a box shared with a CPU hog, DROP DATABASE took over 30 s, so it is generous.
const setupTimeout = 3 * time.Minute

func firstEnv(def string, names ...string) string {
	for _, n := range names {
		if v := os.Getenv(n); v != "" {
			return v
		}
	}
	return def
}

// randomName returns prefix followed by 12 random hex characters.
func randomName(prefix string) string {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return prefix + hex.EncodeToString(b)
}

// FreePort returns a loopback TCP port that was free a moment ago.
func FreePort(t testing.TB) int {
	t.Helper()
	p, err := localserver.FreePort()
	if err != nil {
		t.Fatalf("testenv: find a free port: %v", err)
	}
	return p
}

// Context returns a context cancelled when the test ends or after d, whichever is first.
func Context(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func sanitize(name string) string {
	return strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			return r
		}
		if r >= 'A' && r <= 'Z' {
			return r + 'a' - 'A'
		}
		return '_'
	}, name)
}

func fatalf(t testing.TB, format string, args ...any) {
	t.Helper()
	t.Fatalf("testenv: "+format, args...)
}
