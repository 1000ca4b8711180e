// Package workerconf builds what an idemq worker process runs with, once, for the
// `idemq worker` binary and for the in-process benchmark, so that the two cannot drift:
// the asynq server's configuration and the Postgres pool's size.
package workerconf

import (
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/idempotency/asynqmw"
)

// How often an idle asynq server looks for work. asynq's processor sleeps about
// TaskCheckInterval after it finds its queues empty, so this is what a job enqueued into
// an idle worker waits before it starts (asynq's default, 1 s, made a web request's job
// wait 0.5–1.5 s); the forwarder moves due retries and scheduled tasks back to pending
// every DelayedTaskCheckInterval (asynq stores their times in whole seconds), so a busy
// delivery's retry waits up to that long more. Each costs one Redis script call per
// interval per worker process while it is idle.
const (
	TaskCheckInterval        = 100 * time.Millisecond
	DelayedTaskCheckInterval = 100 * time.Millisecond
)

// AsynqConfig is the asynq server configuration of an idemq worker of concurrency
// serving queues: the intervals above, shutdown after shutdownTimeout, and the
// middleware's failure and retry rules (asynqmw.Configure). The caller adds its logger
// and error handler.
func AsynqConfig(concurrency int, queues map[string]int, shutdownTimeout time.Duration) asynq.Config {
	cfg := asynq.Config{
		Concurrency:              concurrency,
		Queues:                   queues,
		ShutdownTimeout:          shutdownTimeout,
		TaskCheckInterval:        TaskCheckInterval,
		DelayedTaskCheckInterval: DelayedTaskCheckInterval,
	}
	asynqmw.Configure(&cfg)
	return cfg
}

// PoolSize is the worker's Postgres pool size for concurrency on cores CPUs: deliveries
// share the ledger's commits (one committer per kind), so the pool follows the cores, not
// the concurrency: min(concurrency + 4, 4 × cores + 8), the four for the outbox relay, the
// reconciler and the purge. An explicit pool_max_conns in DATABASE_URL wins.
func PoolSize(concurrency, cores int) int32 {
	return int32(min(concurrency+4, 4*cores+8))
}
