package testenv

import (
	"testing"

	"github.com/idemq/idemq/internal/localserver"
)

// PrivatePostgres is a private Postgres server (fsync on) with Kill, Stop, StopImmediate,
// Start, Pause and Resume; URL connects as the superuser postgres.
type PrivatePostgres = localserver.Postgres

// PrivateRedis is a private Redis server with Kill, Stop, Start, Pause and Resume.
type PrivateRedis = localserver.Redis

// Persistence is how a private Redis keeps its data across restarts.
type Persistence = localserver.Persistence

// Redis persistence modes.
const (
	PersistNone        = localserver.PersistNone
	PersistAOFEverySec = localserver.PersistAOFEverySec
	PersistAOFAlways   = localserver.PersistAOFAlways
)

// StartPostgres starts a private Postgres for the test (see localserver.StartPostgres),
// killed and removed when the test ends.
func StartPostgres(t testing.TB) *PrivatePostgres {
	t.Helper()
	s, err := localserver.StartPostgres()
	if err != nil {
		fatalf(t, "start a private Postgres: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// StartPair starts a private Postgres and a streaming standby of it, synchronous or not
// (see localserver.StartStandby), for the test; it skips the test when pg_basebackup is
// not installed, except under CI.
func StartPair(t testing.TB, synchronous bool) (primary, standby *PrivatePostgres) {
	t.Helper()
	NeedBinary(t, "pg_basebackup", "apt-get install -y postgresql")
	primary = StartPostgres(t)
	standby, err := localserver.StartStandby(primary, synchronous)
	if err != nil {
		fatalf(t, "start a standby: %v", err)
	}
	t.Cleanup(func() { standby.Close() })
	return primary, standby
}

// StartRedis starts a private Redis with the given persistence for the test, killed and
// removed when the test ends.
func StartRedis(t testing.TB, mode Persistence) *PrivateRedis {
	t.Helper()
	s, err := localserver.StartRedis(mode)
	if err != nil {
		fatalf(t, "start a private Redis: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}
