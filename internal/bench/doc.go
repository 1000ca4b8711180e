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
// `idemq bench` is the command; Main parses its flags and Run does the work:
//
//	report, err := bench.Run(ctx, bench.Options{RedisURL: r, DatabaseURL: d, Reps: 3, Seconds: 2}, os.Stderr)
//	report.WriteTable(os.Stdout)
package bench
