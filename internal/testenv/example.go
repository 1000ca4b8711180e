package testenv

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/internal/localserver"
)

// ExamplePostgres is Postgres for an Example function, which has no testing.TB: a pool on
// a fresh schema of its own on the shared test database (see PostgresURL), migrated with
// both sets when migrate is set (see Migrate), and a function that closes the pool and
// drops the schema. It panics, with the hint a test would fail with, when the server does
// not answer.
func ExamplePostgres(migrate bool) (pool *pgxpool.Pool, cleanup func()) {
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	base := firstEnv(DefaultDatabaseURL, "TEST_DATABASE_URL", "DATABASE_URL")
	schema, err := localserver.CreateSchema(ctx, base, randomName("example_"), nil)
	if err != nil {
		panic(fmt.Sprintf("testenv: %v; %s", err, postgresHint))
	}
	drop := func() {
		ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
		defer cancel()
		if err := schema.Drop(ctx); err != nil {
			panic(fmt.Sprintf("testenv: %v", err))
		}
	}
	if migrate {
		if err := Migrate(ctx, schema.URL); err != nil {
			drop()
			panic(fmt.Sprintf("testenv: migrate schema %s: %v", schema.Name, err))
		}
	}
	pool, err = pgxpool.New(ctx, schema.URL)
	if err != nil {
		drop()
		panic(fmt.Sprintf("testenv: open pool: %v", err))
	}
	return pool, func() { pool.Close(); drop() }
}

// ExampleRedis is Redis for an Example function: a client on a database leased for it
// (see RedisURL), and a function that closes the client, empties the database and gives
// it back. It panics, with the hint a test would fail with, when the server does not
// answer.
func ExampleRedis() (rdb *redis.Client, cleanup func()) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	base := firstEnv(DefaultRedisURL, "TEST_REDIS_URL", "REDIS_URL")
	db, err := localserver.LeaseRedisDB(ctx, base, false)
	if err != nil {
		panic(fmt.Sprintf("testenv: Redis at %s: %v; %s", base, err, redisHint))
	}
	opt, err := redis.ParseURL(db.URL)
	if err != nil {
		db.Release(false)
		panic(fmt.Sprintf("testenv: parse Redis URL: %v", err))
	}
	rdb = redis.NewClient(opt)
	return rdb, func() {
		rdb.Close()
		if err := db.Release(false); err != nil {
			panic(fmt.Sprintf("testenv: release Redis database %d: %v", db.DB, err))
		}
	}
}
