package testenv

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const redisHint = "start one with `redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no` " +
	"(or `docker compose up -d redis`), or point TEST_REDIS_URL at one"

// dbLeaseTTL bounds how long a crashed test process can keep a database number.
const dbLeaseTTL = 10 * time.Minute

// RedisURL leases a Redis database number of its own on the shared server for the test
// and returns its URL. asynq's keys cannot be prefixed, so isolation is by database: no
// other test (in this or another test process) uses the number until the test ends. The
// database is emptied when leased and when released. Database 0 holds only the leases.
// The server is read from TEST_REDIS_URL, then REDIS_URL, then DefaultRedisURL.
func RedisURL(t testing.TB) string {
	t.Helper()
	base := firstEnv(DefaultRedisURL, "TEST_REDIS_URL", "REDIS_URL")
	opt, err := redis.ParseURL(base)
	if err != nil {
		fatalf(t, "parse Redis URL: %v", err)
	}
	opt.DB = 0
	admin := redis.NewClient(opt)
	defer admin.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := admin.Ping(ctx).Err(); err != nil {
		fatalf(t, "Redis at %s does not answer: %v; %s", opt.Addr, err, redisHint)
	}
	n, err := databases(ctx, admin)
	if err != nil {
		fatalf(t, "%v", err)
	}
	token := randomName("lease-")
	db := 0
	for db == 0 {
		for i := 1; i < n; i++ {
			ok, err := admin.SetNX(ctx, leaseKey(i), token, dbLeaseTTL).Result()
			if err != nil {
				fatalf(t, "lease a Redis database: %v", err)
			}
			if ok {
				db = i
				break
			}
		}
		if db == 0 {
			select {
			case <-ctx.Done():
				fatalf(t, "no free Redis database among %d after waiting: too many tests at once", n-1)
			case <-time.After(100 * time.Millisecond):
			}
		}
	}

	opt.DB = db
	flush := func() error {
		c := redis.NewClient(opt)
		defer c.Close()
		return c.FlushDB(context.Background()).Err()
	}
	if err := flush(); err != nil {
		fatalf(t, "empty Redis database %d: %v", db, err)
	}
	t.Cleanup(func() {
		if err := flush(); err != nil {
			t.Errorf("testenv: empty Redis database %d: %v", db, err)
		}
		c := redis.NewClient(&redis.Options{Addr: opt.Addr, Username: opt.Username, Password: opt.Password, TLSConfig: opt.TLSConfig})
		defer c.Close()
		// Release only our own lease.
		const release = `if redis.call("GET", KEYS[1]) == ARGV[1] then return redis.call("DEL", KEYS[1]) end return 0`
		if err := c.Eval(context.Background(), release, []string{leaseKey(db)}, token).Err(); err != nil {
			t.Errorf("testenv: release Redis database %d: %v", db, err)
		}
	})
	return redisURL(opt)
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

func leaseKey(db int) string { return "idemq-test:db-lease:" + strconv.Itoa(db) }

func databases(ctx context.Context, c *redis.Client) (int, error) {
	v, err := c.ConfigGet(ctx, "databases").Result()
	if err != nil {
		return 0, fmt.Errorf("read Redis 'databases': %w", err)
	}
	n, err := strconv.Atoi(v["databases"])
	if err != nil || n < 2 {
		return 0, errors.New("the test Redis needs at least 2 databases (config 'databases')")
	}
	return n, nil
}

func redisURL(opt *redis.Options) string {
	scheme := "redis"
	if opt.TLSConfig != nil {
		scheme = "rediss"
	}
	auth := ""
	if opt.Password != "" {
		auth = opt.Username + ":" + opt.Password + "@"
	}
	return fmt.Sprintf("%s://%s%s/%d", scheme, auth, opt.Addr, opt.DB)
}
