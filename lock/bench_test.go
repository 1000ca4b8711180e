package lock_test

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"sync/atomic"
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
