// Package lock provides Redis mutual exclusion with a TTL that is safe to release,
// refresh and lose.
//
// A lock is a Redis key set with SET NX PX to a random token from crypto/rand. Refresh,
// Release and TTL run small Lua scripts (EVALSHA, falling back to EVAL once per server)
// that act only while the key still holds our token, so nobody can release or extend a
// lock they no longer hold. A lock's TTL bounds how long a crashed holder blocks others;
// for long work, a Batcher keeps the lock alive (Batcher.Keep) and reports its loss as
// soon as a refresh finds it gone, or once the TTL has run out by our own clock while
// Redis cannot be reached.
//
// A Batcher also shares a process's round trips among its locks: the Obtain calls of the
// moment go in one pipeline, one refresh loop refreshes every lock it keeps in one
// pipeline, and releases are queued and sent together (Batcher.Release), with the
// caller's own script calls when it sends them along (Batcher.Send).
//
// The lock is a fast path, not a proof: a Redis failover or restart without persistence
// can let two holders overlap. Work whose correctness matters needs a fence elsewhere
// (idemq's Postgres ledger). The package knows nothing of asynq or Postgres.
//
// Usage:
//
//	locker := lock.New(rdb, nil)     // keys are prefixed "idemq:lock:"
//	batch := lock.NewBatcher(locker) // one per process, shared by its goroutines
//
//	lk, err := batch.Obtain(ctx, "customer:42", 30*time.Second, nil)
//	if errors.Is(err, lock.ErrNotObtained) {
//		return errBusy // someone else holds it; try again later
//	} else if err != nil {
//		return err
//	}
//	workCtx, cancel := context.WithCancelCause(ctx)
//	stop := batch.Keep(lk, cancel) // refreshed until stop; workCtx cancelled if lost
//	err = doWork(workCtx)          // context.Cause(workCtx) is ErrLockLost if it was lost
//	stop()
//	cancel(nil)
//	batch.Release(lk, nil) // queued: the caller does not wait for Redis
//	return err
//
// and batch.Wait() before closing the client, so that every queued release is sent.
package lock
