// Package dial opens idemq's connections to Redis and Postgres and checks that they
// answer, so a program fails at start with one clear line instead of on its first task.
package dial

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/internal/config"
)

// Redis connects to the Redis at url and pings it (within 10 s). Commands are bounded by
// their contexts (ContextTimeoutEnabled), so a paused or partitioned Redis cannot hang a
// caller past its deadline. Errors never show the URL's password.
func Redis(ctx context.Context, url string) (*redis.Client, error) {
	opt, err := redis.ParseURL(url)
	if err != nil {
		return nil, fmt.Errorf("REDIS_URL: %w", config.URLError(url, err))
	}
	opt.ContextTimeoutEnabled = true
	rdb := redis.NewClient(opt)
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := rdb.Ping(pctx).Err(); err != nil {
		rdb.Close()
		return nil, fmt.Errorf("connect to Redis (REDIS_URL): %w", err)
	}
	return rdb, nil
}

// Postgres opens a pool on dsn of at most maxConns connections (0 keeps pgx's default;
// a pool_max_conns the DSN sets wins over both) and pings it (within 10 s). Errors never
// show the DSN's password.
func Postgres(ctx context.Context, dsn string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", config.URLError(dsn, err))
	}
	if maxConns > 0 && !setsMaxConns(dsn) {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to Postgres: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect to Postgres (DATABASE_URL): %w", err)
	}
	return pool, nil
}

// setsMaxConns reports whether dsn, a URL or a key=value DSN, sets pool_max_conns.
func setsMaxConns(dsn string) bool {
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		return u.Query().Has("pool_max_conns")
	}
	for _, f := range strings.Fields(dsn) {
		if strings.HasPrefix(f, "pool_max_conns=") {
			return true
		}
	}
	return false
}
