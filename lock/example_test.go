package lock_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/lock"
)

// exampleClient connects to REDIS_URL (default redis://127.0.0.1:6379/0). The examples
// use random keys under their own prefix and release them.
func exampleClient() *redis.Client {
	url := os.Getenv("REDIS_URL")
	if url == "" {
		url = "redis://127.0.0.1:6379/0"
	}
	opt, err := redis.ParseURL(url)
	if err != nil {
		panic(err)
	}
	return redis.NewClient(opt)
}

func Example() {
	ctx := context.Background()
	rdb := exampleClient()
	defer rdb.Close()
	locker := lock.New(rdb, &lock.Config{Prefix: "idemq-example:lock:"})
	key := "customer:" + rand.Text()

	lk, err := locker.Obtain(ctx, key, 10*time.Second, nil)
	if err != nil {
		fmt.Println("obtain:", err)
		return
	}
	fmt.Println("obtained")

	// A second worker finds the key busy (no retries by default).
	_, err = locker.Obtain(ctx, key, 10*time.Second, nil)
	fmt.Println("second worker:", err, errors.Is(err, lock.ErrNotObtained))

	if err := lk.Refresh(ctx, 20*time.Second); err != nil {
		fmt.Println("refresh:", err)
	}
	ttl, _ := lk.TTL(ctx)
	fmt.Println("ttl above 10s:", ttl > 10*time.Second)

	fmt.Println("release:", lk.Release(ctx))
	fmt.Println("release again:", lk.Release(ctx))
	// Output:
	// obtained
	// second worker: lock: not obtained true
	// ttl above 10s: true
	// release: <nil>
	// release again: lock: lost
}

func ExampleBatcher() {
	ctx := context.Background()
	rdb := exampleClient()
	defer rdb.Close()
	locker := lock.New(rdb, &lock.Config{Prefix: "idemq-example:lock:"})
	batch := lock.NewBatcher(locker) // one per process, shared by its goroutines
	id := rand.Text()

	// Ten goroutines obtain ten locks at once: their tries share round trips.
	locks := make([]*lock.Lock, 10)
	var wg sync.WaitGroup
	for i := range locks {
		wg.Go(func() {
			lk, err := batch.Obtain(ctx, fmt.Sprintf("job:%s:%d", id, i), 300*time.Millisecond, nil)
			if err != nil {
				fmt.Println("obtain:", err)
				return
			}
			locks[i] = lk
		})
	}
	wg.Wait()

	// One loop keeps them all alive, refreshing them together every TTL/3.
	stops := make([]func() error, len(locks))
	for i, lk := range locks {
		stops[i] = batch.Keep(lk, func(cause error) { fmt.Println("lost:", cause) })
	}
	time.Sleep(time.Second) // long work: more than 3× the TTL

	// Releases are queued and go together; Wait waits until they are answered.
	var released atomic.Int32
	for i, lk := range locks {
		if err := stops[i](); err != nil {
			fmt.Println("stop:", err)
		}
		batch.Release(lk, func(err error) {
			if err == nil {
				released.Add(1)
			}
		})
	}
	batch.Wait()
	fmt.Println("released:", released.Load())
	// Output:
	// released: 10
}

func ExampleBatcher_Keep() {
	ctx := context.Background()
	rdb := exampleClient()
	defer rdb.Close()
	locker := lock.New(rdb, &lock.Config{Prefix: "idemq-example:lock:"})
	batch := lock.NewBatcher(locker)
	key := "report:" + rand.Text()

	// Obtain retries for a while when the key is busy.
	lk, err := batch.Obtain(ctx, key, 300*time.Millisecond,
		&lock.Options{Retry: lock.ExponentialBackoff(10*time.Millisecond, time.Second, 5)})
	if err != nil {
		fmt.Println("obtain:", err)
		return
	}
	// Keep refreshes the lock every TTL/3 until stop, and cancels the work if it is lost.
	workCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := batch.Keep(lk, cancel)
	defer stop()

	time.Sleep(time.Second) // long work: more than 3× the TTL
	fmt.Println("work:", workCtx.Err())

	// Somebody deletes the key behind our back: the next refresh finds it gone.
	rdb.Del(ctx, locker.RedisKey(key))
	<-workCtx.Done()
	fmt.Println("cause:", context.Cause(workCtx))
	fmt.Println("stop:", stop())
	// Output:
	// work: <nil>
	// cause: lock: lost
	// stop: lock: lost
}
