package asynqmw

import (
	"context"
	_ "embed"
	"encoding/json"
	"fmt"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency/internal/asynqkeys"
	"github.com/idemq/idemq/lock"
)

var (
	//go:embed result_write.lua
	writeResultLua    string
	writeResultScript = redis.NewScript(writeResultLua)

	//go:embed release_result.lua
	releaseResultLua    string
	releaseResultScript = redis.NewScript(releaseResultLua)
)

// resultWrite is a result on its way to a task's asynq hash, in a pipeline of the
// Worker's results Batcher, with the release of the scope's lock when one goes back to
// Redis at the same time. The delivery waits for it (Batcher.Do), while ctx lasts: asynq
// shows the task completed once it returns.
type resultWrite struct {
	ctx    context.Context // the delivery's
	key    string          // asynq's task hash
	result []byte
	report func(written int64, err error) // logs the outcome
}

// newResultWrite returns the write of result to t's hash when the middleware writes it
// (see writeResult) through its results Batcher; nil when there is nothing to write that
// way.
func (h *handler[T]) newResultWrite(ctx context.Context, t *asynq.Task, result json.RawMessage, key string) *resultWrite {
	w := t.ResultWriter()
	queue, _ := asynq.GetQueueName(ctx)
	if h.w.results == nil || w == nil || queue == "" || len(result) == 0 || len(result) > MaxResultWriteBytes || ctx.Err() != nil {
		return nil
	}
	return &resultWrite{ctx: ctx, key: asynqkeys.Task(queue, w.TaskID()), result: result,
		report: func(n int64, err error) {
			if err != nil {
				h.log(ctx, key).DebugContext(ctx, "write task result", "err", err)
			} else if n < 0 {
				h.log(ctx, key).InfoContext(ctx, "task gone from Redis; result kept in the ledger only", "task_id", w.TaskID())
			}
		}}
}

// call returns the script call that writes the result on its own.
func (rw *resultWrite) call() lock.Call {
	return lock.Call{Script: writeResultScript, Keys: []string{rw.key}, Args: []any{rw.result}, Done: func(cmd *redis.Cmd) {
		n, err := cmd.Int64()
		rw.report(n, err)
	}}
}

// sendRelease queues lk's release (then gets its outcome) and, when rw is not nil, sends
// the result write with it and waits for both: one script call when both keys are on the
// one Redis server, two calls in one pipeline otherwise.
func (w *Worker) sendRelease(lk *lock.Lock, rw *resultWrite, then func(error)) {
	switch {
	case rw == nil:
		w.batch.Release(lk, then)
	case w.combine:
		rkey := w.locker.RedisKey(lk.Key())
		w.batch.Do(rw.ctx, lock.Call{Script: releaseResultScript, Keys: []string{rkey, rw.key}, Args: []any{lk.Token(), rw.result},
			Done: func(cmd *redis.Cmd) {
				vals, err := cmd.Int64Slice()
				switch {
				case err != nil:
					then(fmt.Errorf("lock: release %q: %w", lk.Key(), err))
					rw.report(0, err)
					return
				case len(vals) != 2:
					err := fmt.Errorf("release_result.lua answered %v", vals)
					then(err)
					rw.report(0, err)
					return
				case vals[0] != 1:
					then(lock.ErrLockLost)
				default:
					then(nil)
				}
				rw.report(vals[1], nil)
			}})
	case w.results == w.batch:
		w.batch.Do(rw.ctx, lk.ReleaseCall(then), rw.call())
	default:
		w.batch.Release(lk, then)
		w.results.Do(rw.ctx, rw.call())
	}
}

// sendResult sends rw on its own, with the other calls of the moment, and waits for it.
func (w *Worker) sendResult(rw *resultWrite) {
	if rw != nil {
		w.results.Do(rw.ctx, rw.call())
	}
}
