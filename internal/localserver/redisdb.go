package localserver

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/lock"
)

// leaseTTL bounds how long a crashed lease holder keeps a database number.
const leaseTTL = 2 * time.Minute

// RedisDB is a Redis database number leased for one user (a test, a demo phase): no other
// LeaseRedisDB caller, in any process, gets it until Release. asynq's keys cannot be
// prefixed, so isolation on a shared server is by database. Database 0 holds the leases
// (keys idemq:db-lease:N) and is never handed out.
type RedisDB struct {
	// URL is the base URL with the leased database number.
	URL string
	// DB is the leased number.
	DB int

	admin   *redis.Client
	lk      *lock.Lock
	stopKA  func() error
	options *redis.Options
}

// LeaseRedisDB leases a database on the server at base, waiting until ctx ends while all
// are taken. With requireEmpty it skips databases that hold keys (someone else's data);
// without, it empties the one it leases. The lease is kept alive until Release.
func LeaseRedisDB(ctx context.Context, base string, requireEmpty bool) (*RedisDB, error) {
	opt, err := redis.ParseURL(base)
	if err != nil {
		return nil, fmt.Errorf("parse Redis URL: %w", err)
	}
	opt.DB = 0
	admin := redis.NewClient(opt)
	if err := admin.Ping(ctx).Err(); err != nil {
		admin.Close()
		return nil, err
	}
	v, err := admin.ConfigGet(ctx, "databases").Result()
	n, _ := strconv.Atoi(v["databases"])
	if err != nil || n < 2 {
		admin.Close()
		return nil, errors.New("the Redis server needs at least 2 databases (config 'databases')")
	}
	locker := lock.New(admin, &lock.Config{Prefix: "idemq:db-lease:"})
	keeper := lock.NewBatcher(locker)
	for {
		for db := 1; db < n; db++ {
			lk, err := locker.Obtain(ctx, strconv.Itoa(db), leaseTTL, nil)
			if errors.Is(err, lock.ErrNotObtained) {
				continue
			}
			if err != nil {
				admin.Close()
				return nil, fmt.Errorf("lease a Redis database: %w", err)
			}
			o := *opt
			o.DB = db
			c := redis.NewClient(&o)
			size, err := c.DBSize(ctx).Result()
			if err == nil && size > 0 {
				if requireEmpty {
					c.Close()
					lk.Release(context.WithoutCancel(ctx))
					continue
				}
				err = c.FlushDB(ctx).Err()
			}
			c.Close()
			if err != nil {
				lk.Release(context.WithoutCancel(ctx))
				admin.Close()
				return nil, fmt.Errorf("prepare Redis database %d: %w", db, err)
			}
			// A lost lease goes unreported: it is only a courtesy between test processes.
			stop := keeper.Keep(lk, nil)
			u, _ := url.Parse(base)
			u.Path = "/" + strconv.Itoa(db)
			return &RedisDB{URL: u.String(), DB: db, admin: admin, lk: lk, stopKA: stop, options: &o}, nil
		}
		select {
		case <-ctx.Done():
			admin.Close()
			return nil, fmt.Errorf("no free Redis database among %d: %w", n-1, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Release empties the database (unless keep) and gives the number back.
func (d *RedisDB) Release(keep bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var err error
	if !keep {
		c := redis.NewClient(d.options)
		err = c.FlushDB(ctx).Err()
		c.Close()
	}
	d.stopKA()
	if rerr := d.lk.Release(ctx); rerr != nil && !errors.Is(rerr, lock.ErrLockLost) {
		err = errors.Join(err, rerr)
	}
	d.admin.Close()
	return err
}
