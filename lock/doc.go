// Package lock provides Redis mutual exclusion with a TTL that is safe to release,
// refresh and lose.
//
// A lock is a Redis key set with SET NX PX to a random token from crypto/rand. Refresh,
// Release and TTL run small Lua scripts (EVALSHA, falling back to EVAL once per server)
// that act only while the key still holds our token, so nobody can release or extend a
// lock they no longer hold. A lock's TTL bounds how long a crashed holder blocks others;
// a watchdog (Lock.Watch, Locker.Hold) keeps it alive for long work and cancels the
// work the moment the lock is lost, or once the TTL has run out by our own clock while
// Redis cannot be reached.
//
// A process that takes many locks at once (a worker taking one per delivery) shares its
// round trips through a Batcher: the Obtain calls of the moment go in one pipeline, one
// refresh loop refreshes every lock it keeps (Batcher.Keep) in one pipeline, and
// releases are queued and sent together (Batcher.Release), with the caller's own script
// calls when it sends them along (Batcher.Send).
//
// The lock is a fast path, not a proof: a Redis failover or restart without persistence
// can let two holders overlap. Work whose correctness matters needs a fence elsewhere
// (idemq's Postgres ledger). The package knows nothing of asynq or Postgres.
//
// Usage:
//
//	locker := lock.New(rdb, nil) // keys are prefixed "idemq:lock:"
//
//	lk, err := locker.Obtain(ctx, "customer:42", 30*time.Second, nil)
//	if errors.Is(err, lock.ErrNotObtained) {
//		return errBusy // someone else holds it; try again later
//	} else if err != nil {
//		return err
//	}
//	defer lk.Release(context.WithoutCancel(ctx))
//
//	workCtx, stop := lk.Watch(ctx, nil) // refresh every 10s; cancel workCtx if lost
//	defer stop()
//	return doWork(workCtx) // context.Cause(workCtx) is ErrLockLost if the lock was lost
//
// With a Batcher, shared by the process's callers:
//
//	batch := lock.NewBatcher(locker)
//	lk, err := batch.Obtain(ctx, "customer:42", 30*time.Second, nil) // errors as above
//	...
//	stop := batch.Keep(lk, func(cause error) { cancelWork(cause) }) // refreshed every 10s
//	err = doWork(workCtx)
//	stop()
//	batch.Release(lk, nil) // queued: the caller does not wait for Redis
//	...
//	batch.Wait() // before closing the client: every queued release is sent
//
// Or, in one call, retrying for a while:
//
//	err := locker.Hold(ctx, "customer:42", 30*time.Second,
//		&lock.Options{Retry: lock.ExponentialBackoff(10*time.Millisecond, time.Second, 8)}, nil,
//		func(ctx context.Context) error { return doWork(ctx) })
package lock
