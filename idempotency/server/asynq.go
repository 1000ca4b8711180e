package server

import (
	"fmt"
	"log/slog"
	"os"
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

// AsynqConfig is the asynq server configuration a Server runs with for concurrency,
// queues and shutdownTimeout: the intervals above and the middleware's failure and retry
// rules (asynqmw.Configure). New adds a logger and an error handler; a program that runs
// its own asynq.Server with idemq's handlers can start from it.
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

// PoolSize is the Postgres pool size a Server of concurrency needs on cores CPUs
// (runtime.GOMAXPROCS(0)): deliveries share the ledger's commits (one committer per
// kind), so the pool follows the cores, not the concurrency: min(concurrency + 4,
// 4 × cores + 8), the four for the outbox relay, the reconciler and the purge. Set it as
// the pool's MaxConns (pgxpool.Config.MaxConns).
func PoolSize(concurrency, cores int) int32 {
	return int32(min(concurrency+4, 4*cores+8))
}

// MinRetention is the shortest ledger retention that keeps a key as long as asynq may
// still deliver its task: taskRetention (how long asynq keeps a completed task, whose
// TaskID stays taken), plus the longest retry horizon of maxRetry retries under asynq's
// default backoff at its worst, plus busyBudget (how long a task may retry as busy). A
// key purged sooner could run again when a late retry arrives.
func MinRetention(taskRetention time.Duration, maxRetry int, busyBudget time.Duration) time.Duration {
	var horizon time.Duration
	for n := 0; n < maxRetry; n++ {
		// asynq.DefaultRetryDelayFunc: n^4 + 15 + rand(30)*(n+1) seconds.
		horizon += time.Duration(n*n*n*n+15+29*(n+1)) * time.Second
	}
	return taskRetention + horizon + busyBudget
}

// asynqLogger feeds asynq's log lines to slog.
type asynqLogger struct{ l *slog.Logger }

func (a asynqLogger) Debug(args ...any) { a.l.Debug(fmt.Sprint(args...)) }
func (a asynqLogger) Info(args ...any)  { a.l.Info(fmt.Sprint(args...)) }
func (a asynqLogger) Warn(args ...any)  { a.l.Warn(fmt.Sprint(args...)) }
func (a asynqLogger) Error(args ...any) { a.l.Error(fmt.Sprint(args...)) }

// Fatal logs and exits, as asynq's own logger does: asynq calls it only when it cannot
// go on.
func (a asynqLogger) Fatal(args ...any) { a.l.Error(fmt.Sprint(args...)); os.Exit(1) }
