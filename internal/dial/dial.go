// Package dial opens idemq's connections to Redis and Postgres and checks that they
// answer, so a program fails at start with one clear line instead of on its first task.
package dial

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency/pgpooler"
	"github.com/idemq/idemq/internal/config"
)

// Redis connects to the Redis that redisURL names and pings it (within 10 s):
//   - a single node, redis://[user:pass@]host:port/db (redis.ParseURL);
//   - a Sentinel-monitored master, redis://[user:pass@]sentinel:26379/db?master_name=NAME
//     &addr=sentinel2:26379&addr=… (redis.ParseFailoverURL): the client asks the
//     Sentinels for the master and follows it across a failover;
//   - with cluster, a Redis Cluster, redis://[user:pass@]node:port?addr=node2:port&addr=…
//     (redis.ParseClusterURL).
//
// Commands are bounded by their contexts (ContextTimeoutEnabled), so a paused or
// partitioned Redis cannot hang a caller past its deadline. Errors never show the URL's
// password.
func Redis(ctx context.Context, redisURL string, cluster bool) (redis.UniversalClient, error) {
	rdb, err := newRedis(redisURL, cluster)
	if err != nil {
		return nil, err
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := rdb.Ping(pctx).Err(); err != nil {
		rdb.Close()
		return nil, fmt.Errorf("connect to Redis (REDIS_URL): %w", err)
	}
	return rdb, nil
}

// RedisNode is Redis for a single node only, for the tools that need a *redis.Client.
func RedisNode(ctx context.Context, redisURL string) (*redis.Client, error) {
	if IsFailoverURL(redisURL) {
		return nil, errors.New("REDIS_URL: a single node is needed here, not a Sentinel URL")
	}
	rdb, err := Redis(ctx, redisURL, false)
	if err != nil {
		return nil, err
	}
	return rdb.(*redis.Client), nil
}

func newRedis(redisURL string, cluster bool) (redis.UniversalClient, error) {
	switch {
	case cluster:
		opt, err := redis.ParseClusterURL(redisURL)
		if err != nil {
			return nil, fmt.Errorf("REDIS_URL (IDEMQ_REDIS_CLUSTER=true): %w", config.RedisURLError(redisURL, err))
		}
		opt.ContextTimeoutEnabled = true
		return redis.NewClusterClient(opt), nil
	case IsFailoverURL(redisURL):
		opt, err := redis.ParseFailoverURL(redisURL)
		if err != nil {
			return nil, fmt.Errorf("REDIS_URL: %w", config.RedisURLError(redisURL, err))
		}
		opt.ContextTimeoutEnabled = true
		return redis.NewFailoverClient(opt), nil
	}
	opt, err := redis.ParseURL(redisURL)
	if err != nil {
		return nil, fmt.Errorf("REDIS_URL: %w", config.RedisURLError(redisURL, err))
	}
	opt.ContextTimeoutEnabled = true
	return redis.NewClient(opt), nil
}

// IsFailoverURL reports whether redisURL names a Sentinel-monitored master (a master_name
// parameter).
func IsFailoverURL(redisURL string) bool {
	u, err := url.Parse(redisURL)
	return err == nil && u.Query().Has("master_name")
}

// AsynqRedis is the asynq connection option for the same Redis as Redis(redisURL, cluster),
// for what asynq builds its own clients from (the dashboard).
func AsynqRedis(redisURL string, cluster bool) (asynq.RedisConnOpt, error) {
	switch {
	case cluster:
		opt, err := redis.ParseClusterURL(redisURL)
		if err != nil {
			return nil, fmt.Errorf("REDIS_URL: %w", config.RedisURLError(redisURL, err))
		}
		return asynq.RedisClusterClientOpt{Addrs: opt.Addrs, Username: opt.Username, Password: opt.Password,
			TLSConfig: opt.TLSConfig, DialTimeout: opt.DialTimeout, ReadTimeout: opt.ReadTimeout, WriteTimeout: opt.WriteTimeout}, nil
	case IsFailoverURL(redisURL):
		opt, err := redis.ParseFailoverURL(redisURL)
		if err != nil {
			return nil, fmt.Errorf("REDIS_URL: %w", config.RedisURLError(redisURL, err))
		}
		return asynq.RedisFailoverClientOpt{MasterName: opt.MasterName, SentinelAddrs: opt.SentinelAddrs,
			SentinelPassword: opt.SentinelPassword, Username: opt.Username, Password: opt.Password, DB: opt.DB,
			TLSConfig: opt.TLSConfig, DialTimeout: opt.DialTimeout, ReadTimeout: opt.ReadTimeout, WriteTimeout: opt.WriteTimeout}, nil
	}
	opt, err := redis.ParseURL(redisURL)
	if err != nil {
		return nil, fmt.Errorf("REDIS_URL: %w", config.RedisURLError(redisURL, err))
	}
	return asynq.RedisClientOpt{Network: opt.Network, Addr: opt.Addr, Username: opt.Username, Password: opt.Password, DB: opt.DB,
		TLSConfig: opt.TLSConfig, DialTimeout: opt.DialTimeout, ReadTimeout: opt.ReadTimeout, WriteTimeout: opt.WriteTimeout}, nil
}

// Postgres opens a pool on dsn of at most maxConns connections (0 keeps pgx's default;
// a pool_max_conns the DSN sets wins over both) and pings it (within 10 s). When dsn
// reaches a transaction-mode pooler (see pgpooler.Detect) and sets no
// default_query_exec_mode, the pool uses cache_describe: unnamed statements, which such a
// pooler serves, with their descriptions cached per connection. Errors never show the
// DSN's password.
func Postgres(ctx context.Context, dsn string, maxConns int32) (*pgxpool.Pool, error) {
	pool, _, err := postgres(ctx, "DATABASE_URL", dsn, maxConns)
	return pool, err
}

func postgres(ctx context.Context, name, dsn string, maxConns int32) (*pgxpool.Pool, pgpooler.Kind, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, 0, fmt.Errorf("%s: %w", name, config.URLError(dsn, err))
	}
	if maxConns > 0 && !setsParam(dsn, "pool_max_conns") {
		cfg.MaxConns = maxConns
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	kind, err := pgpooler.Detect(pctx, cfg.ConnConfig)
	if err != nil {
		return nil, 0, fmt.Errorf("connect to Postgres (%s): %w", name, err)
	}
	if kind == pgpooler.TransactionPooler && !setsParam(dsn, "default_query_exec_mode") {
		cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, 0, fmt.Errorf("connect to Postgres (%s): %w", name, err)
	}
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, 0, fmt.Errorf("connect to Postgres (%s): %w", name, err)
	}
	return pool, kind, nil
}

// PoolerHint adds to err, when it is what named prepared statements meet behind a
// transaction-mode pooler (PgBouncer's pool_mode=transaction), how to run there: pgx's
// default caches named prepared statements per connection, and the pooler hands each
// transaction another server connection.
func PoolerHint(err error) error {
	if pgpooler.IsPreparedStatementError(err) {
		return fmt.Errorf("%w (DATABASE_URL looks like a transaction-mode pooler such as PgBouncer: add default_query_exec_mode=cache_describe to it, or point it at Postgres)", err)
	}
	return err
}

// setsParam reports whether dsn, a URL or a key=value DSN, sets the parameter name.
func setsParam(dsn, name string) bool {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		// Not url.Parse: it refuses the host list of a multi-host URL.
		_, query, _ := strings.Cut(dsn, "?")
		q, _ := url.ParseQuery(query)
		return q.Has(name)
	}
	for _, f := range strings.Fields(dsn) {
		if strings.HasPrefix(f, name+"=") {
			return true
		}
	}
	return false
}
