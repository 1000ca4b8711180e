package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"runtime/metrics"
	"runtime/pprof"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
)

// childFlag, first among idemq-bench's arguments, makes the process a memory-mode
// child: one asynq server of one configuration, nothing else, until SIGTERM.
const childFlag = "-memory-child"

// ChildEnv is set to "1" in the environment of the bench's own children (memory mode's
// servers, drain mode's bare asynq, API mode's load generator), with REDIS_URL and
// DATABASE_URL naming the run's leased Redis database and private schema. A binary that
// does not route its arguments to Main (a test binary) checks it first and calls Main
// with REDIS_URL, DATABASE_URL and its arguments.
const ChildEnv = "IDEMQ_BENCH_MEMORY_CHILD"

// The lines a child writes to stdout, one per line:
//
//	ready                       the server is started
//	progress <done> <errors> <live heap bytes>   every progressEvery while the count changes
//	memstats <JSON childStats>  after SIGTERM, once the server has stopped
//
// With -memprofile the child writes a heap profile there at the end of the load and, on
// SIGUSR1 (sent at the end of the warm-up), one beside it named *-warm.pprof.
const progressEvery = 50 * time.Millisecond

// childStats is what a child reports of its Go heap when it stops.
type childStats struct {
	// At the end of the load, before any collection forced by the child.
	HeapAlloc uint64 `json:"heap_alloc"`
	HeapInuse uint64 `json:"heap_inuse"`
	HeapSys   uint64 `json:"heap_sys"`
	Sys       uint64 `json:"sys"`
	NumGC     uint32 `json:"num_gc"`
	// After runtime.GC: what is still reachable.
	LiveHeapAfterGC uint64 `json:"live_heap_after_gc"`
	Goroutines      int    `json:"goroutines"`
}

// runChild is the memory-mode child: it serves the no-op workload of one configuration
// on the leased Redis database at redisURL (and the schema at databaseURL for the full
// stack) until ctx ends, reporting progress on stdout.
func runChild(ctx context.Context, redisURL, databaseURL string, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("idemq-bench "+childFlag, flag.ContinueOnError)
	fs.SetOutput(stderr)
	config := fs.String("config", ConfigBare, "configuration: A, E or F")
	concurrency := fs.Int("concurrency", 50, "asynq concurrency")
	poolSize := fs.Int("pool", 40, "Postgres connections of the full stack")
	memprofile := fs.String("memprofile", "", "write a heap profile here after SIGTERM")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *memprofile != "" {
		// Finer than the default 512 KiB, so that a growth of a few hundred KiB shows.
		runtime.MemProfileRate = memProfileRate
	}
	w := noopWorkload("noop", 0)
	var st *stack
	switch *config {
	case ConfigBare:
		// A bare asynq process: a Redis client, no Postgres.
		rdb, err := openRedis(ctx, redisURL)
		if err != nil {
			return err
		}
		defer rdb.Close()
		st = &stack{rdb: rdb}
	case ConfigFull, ConfigFullTx:
		var err error
		if st, err = openStack(ctx, redisURL, databaseURL, int32(*poolSize)); err != nil {
			return err
		}
		defer st.close()
	default:
		return fmt.Errorf("bench: %s: configuration %q (want A, E or F)", childFlag, *config)
	}

	var done, errs atomic.Int64
	h := w.handler(*config, st)
	mux := asynq.NewServeMux()
	mux.Handle(w.taskType, asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		err := h.ProcessTask(ctx, t)
		if err != nil {
			errs.Add(1)
		} else {
			done.Add(1)
		}
		return err
	}))
	srv := asynq.NewServerFromRedisClient(st.rdb, serverConfig(*concurrency))
	if err := srv.Start(mux); err != nil {
		return fmt.Errorf("bench: start asynq server: %w", err)
	}
	// SIGUSR1 asks for a heap profile (after a collection) at the end of the warm-up, to
	// set beside the one at the end (go tool pprof -diff_base).
	warm := make(chan os.Signal, 1)
	signal.Notify(warm, syscall.SIGUSR1)
	defer signal.Stop(warm)

	out := bufio.NewWriter(stdout)
	fmt.Fprintln(out, "ready")
	out.Flush()

	live := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	tick := time.NewTicker(progressEvery)
	var lastDone, lastErrs int64 = -1, -1
	for running := true; running; {
		select {
		case <-ctx.Done():
			running = false
		case <-tick.C:
		case <-warm:
			if *memprofile != "" {
				runtime.GC()
				if err := writeHeapProfile(warmProfile(*memprofile)); err != nil {
					return err
				}
			}
			continue
		}
		d, e := done.Load(), errs.Load()
		if d == lastDone && e == lastErrs && running {
			continue
		}
		lastDone, lastErrs = d, e
		metrics.Read(live)
		fmt.Fprintf(out, "progress %d %d %d\n", d, e, live[0].Value.Uint64())
		out.Flush()
	}
	tick.Stop()

	var cs childStats
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	cs.HeapAlloc, cs.HeapInuse, cs.HeapSys, cs.Sys, cs.NumGC = ms.HeapAlloc, ms.HeapInuse, ms.HeapSys, ms.Sys, ms.NumGC
	// The profile and the live heap are taken with the server still up, so they see what
	// asynq and the stack hold, not only what survives a shutdown.
	runtime.GC()
	runtime.ReadMemStats(&ms)
	cs.LiveHeapAfterGC = ms.HeapAlloc
	cs.Goroutines = runtime.NumGoroutine()
	if *memprofile != "" {
		if err := writeHeapProfile(*memprofile); err != nil {
			return err
		}
	}
	srv.Shutdown()
	b, _ := json.Marshal(cs)
	fmt.Fprintf(out, "memstats %s\n", b)
	return out.Flush()
}

// memProfileRate is a profiling child's runtime.MemProfileRate: one sample per 64 KiB
// allocated on average.
const memProfileRate = 64 << 10

// warmProfile names the heap profile taken at the end of the warm-up.
func warmProfile(path string) string {
	return strings.TrimSuffix(path, ".pprof") + "-warm.pprof"
}

// writeHeapProfile writes the heap profile as of the last collection to path.
func writeHeapProfile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
		f.Close()
		return fmt.Errorf("bench: write %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	return nil
}
