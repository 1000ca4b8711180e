// Package bench measures what idemq's layers cost on top of bare asynq: one run
// interleaves configurations (bare asynq, + Redis lock, + ledger leased, + ledger
// transactional, full stack leased, full stack transactional) over repetitions, so every
// figure can be divided by bare asynq's from the same repetition on a noisy machine.
//
// Each measurement pre-enqueues N tasks with distinct keys into a leased, empty Redis
// database, starts asynq servers on it and times the drain (first task started → last
// task done). Per task it records the time spent in the configuration's wrapper outside
// the business function; per measurement it reads CPU time from /proc for this process,
// the redis-server process and this run's Postgres backends plus Postgres' WAL writer,
// checkpointer and background writer.
//
// Memory mode (-memory, RunMemory) instead runs bare asynq (A) and the full stack,
// leased (E) and transactional (F), each in a process of its own (this binary again,
// with -memory-child), serving -memory-tasks no-op tasks (default 100,000) that this
// process enqueues in chunks; it samples the child's VmRSS from /proc every 250 ms and
// reports per configuration the RSS when ready, after the warm-up (the first 10% of the
// tasks) and at the end, the peak (VmHWM), the least-squares slope of RSS and of the Go
// live heap over tasks processed after the warm-up, the child's MemStats at the end, and
// the ratio of each peak to bare asynq's. -memprofile DIR has each child write heap
// profiles at the end of the warm-up and of the load, to compare with
// go tool pprof -diff_base.
//
// Soak mode (-soak, RunSoak) runs the idemq binary's worker on a private Postgres for
// half an hour or more at a steady share of its maximum (measured first by a drain), with
// a retention of minutes, and samples every minute the completions, the delivery latency,
// the ledger tables' sizes, dead tuples and autovacuums, the purge's rows and statement
// times and lock waits behind the purge; at the end it judges the drift against targets
// (evaluateSoak).
//
// idemq-bench (cmd/idemq-bench) is the command; Main parses its flags and Run does the work:
//
//	report, err := bench.Run(ctx, bench.Options{RedisURL: r, DatabaseURL: d, Reps: 3, Seconds: 2}, os.Stderr)
//	report.WriteTable(os.Stdout)
package bench
