package lock_test

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/lock"
)

// The two benchmarks below run side by side in one `go test -bench .` invocation, each
// at 1 and 64 goroutines, on a client configured the same way: BenchmarkRawSetNXDel is
// the floor (SET NX + DEL), BenchmarkObtainRelease adds the token and the EVALSHA
// compare-and-delete. Each goroutine uses a key of its own.

const benchTTL = 10 * time.Second

var benchParallelism = []int{1, 64}

func benchGoroutines(b *testing.B, p int, body func(key string)) {
	b.ReportAllocs()
	if p == 1 {
		for b.Loop() {
			body("bench:0")
		}
		return
	}
	var next atomic.Int64
	b.SetParallelism((p + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
	b.RunParallel(func(pb *testing.PB) {
		key := "bench:" + strconv.FormatInt(next.Add(1), 10)
		for pb.Next() {
			body(key)
		}
	})
}

func BenchmarkRawSetNXDel(b *testing.B) {
	rdb := testenv.Redis(b)
	ctx := context.Background()
	for _, p := range benchParallelism {
		b.Run(fmt.Sprintf("p=%d", p), func(b *testing.B) {
			benchGoroutines(b, p, func(key string) {
				ok, err := rdb.SetNX(ctx, "idemq:lock:"+key, "raw-token", benchTTL).Result()
				if err != nil || !ok {
					b.Errorf("SET NX = %v, %v", ok, err)
					return
				}
				if err := rdb.Del(ctx, "idemq:lock:"+key).Err(); err != nil {
					b.Error(err)
				}
			})
		})
	}
}

func BenchmarkObtainRelease(b *testing.B) {
	rdb := testenv.Redis(b)
	ctx := context.Background()
	locker := lock.New(rdb, nil)
	for _, p := range benchParallelism {
		b.Run(fmt.Sprintf("p=%d", p), func(b *testing.B) {
			benchGoroutines(b, p, func(key string) {
				lk, err := locker.Obtain(ctx, key, benchTTL, nil)
				if err != nil {
					b.Errorf("Obtain: %v", err)
					return
				}
				if err := lk.Release(ctx); err != nil {
					b.Errorf("Release: %v", err)
				}
			})
		})
	}
}

// BenchmarkHeldLock measures a lock per unit of work as a worker takes one per delivery,
// at 10 goroutines, and reports the process's CPU per lock (cpu-µs/op, user + system):
// a Batcher's Obtain, Keep and queued Release.
func BenchmarkHeldLock(b *testing.B) {
	rdb := testenv.Redis(b)
	ctx := context.Background()
	locker := lock.New(rdb, nil)
	const p = 10
	b.Run("batcher", func(b *testing.B) {
		batch := lock.NewBatcher(locker)
		benchCPU(b, p, func(key string) {
			lk, err := batch.Obtain(ctx, key, benchTTL, nil)
			if err != nil {
				b.Errorf("Obtain: %v", err)
				return
			}
			stop := batch.Keep(lk, nil)
			stop()
			batch.Release(lk, nil)
		}, batch.Wait)
	})
}

// benchCPU runs body on p goroutines (a key each, waiting for the previous release of it
// with wait at the end) and reports the process's CPU per op.
func benchCPU(b *testing.B, p int, body func(key string), wait func()) {
	b.ReportAllocs()
	var next atomic.Int64
	cpu0 := processCPU()
	b.SetParallelism((p + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
	b.RunParallel(func(pb *testing.PB) {
		id := next.Add(1)
		n := 0
		for pb.Next() {
			n++
			body("held:" + strconv.FormatInt(id, 10) + ":" + strconv.Itoa(n))
		}
	})
	wait()
	b.ReportMetric(float64((processCPU()-cpu0).Microseconds())/float64(b.N), "cpu-µs/op")
}

// processCPU returns the CPU time the process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
