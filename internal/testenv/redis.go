package testenv

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/internal/localserver"
)

const redisHint = "start one with `redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no` " +
	"(or `docker compose up -d redis`), or point TEST_REDIS_URL at one"

// RedisURL leases a Redis database number of its own on the shared server for the test
// (localserver.LeaseRedisDB) and returns its URL. asynq's keys cannot be prefixed, so
// isolation is by database: no other test, in this or another test process, and no
// `idemq demo` uses the number until the test ends. The database is emptied when leased
// and when released. The server is read from TEST_REDIS_URL, then REDIS_URL, then
// DefaultRedisURL.
func RedisURL(t testing.TB) string {
	t.Helper()
	base := firstEnv(DefaultRedisURL, "TEST_REDIS_URL", "REDIS_URL")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db, err := localserver.LeaseRedisDB(ctx, base, false)
	if err != nil {
		fatalf(t, "Redis at %s: %v; %s", base, err, redisHint)
	}
	t.Cleanup(func() {
		if err := db.Release(false); err != nil {
			t.Errorf("testenv: release Redis database %d: %v", db.DB, err)
		}
	})
	return db.URL
}

// Redis returns a client on a Redis database of the test's own (see RedisURL), closed when
// the test ends.
func Redis(t testing.TB) *redis.Client {
	t.Helper()
	return RedisClient(t, RedisURL(t))
}

// RedisClient opens a client on url and closes it when the test ends.
func RedisClient(t testing.TB, url string) *redis.Client {
	t.Helper()
	opt, err := redis.ParseURL(url)
	if err != nil {
		fatalf(t, "parse Redis URL: %v", err)
	}
	c := redis.NewClient(opt)
	t.Cleanup(func() { c.Close() })
	return c
}
