package idempotency_test

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// The benchmarks come in pairs, each beside its floor, at parallelism 1 and 32:
//
//	BenchmarkDoTx vs BenchmarkBareTx: one transaction inserting one effect row, with and
//	without the ledger (claim, completion and durable commit in the same transaction).
//	BenchmarkDo vs BenchmarkTwoCommits: claim and completion of a no-op handler, against
//	two bare single-statement commits (insert a keyed row, then update it).
//
// All share one pool of 40 connections on one schema. Run them together:
//
//	go test -run '^$' -bench . -benchtime 3s -count 3 ./idempotency/

var benchSeq atomic.Int64

func benchKey(prefix string) string {
	return prefix + strconv.FormatInt(benchSeq.Add(1), 36)
}

type benchEnv struct {
	pool   *pgxpool.Pool
	ledger *idempotency.Ledger
	prefix string
}

func setupBench(b *testing.B) *benchEnv { return setupBenchConfig(b, &idempotency.Config{}) }

func setupBenchConfig(b *testing.B, cfg *idempotency.Config) *benchEnv {
	b.Helper()
	pool := testenv.Pool(b, testenv.PostgresURL(b)+"&pool_max_conns=40")
	ctx := context.Background()
	for _, sql := range []string{
		`CREATE TABLE effects (key text NOT NULL, amount int NOT NULL)`,
		`CREATE TABLE bare_jobs (key text PRIMARY KEY, status text NOT NULL, result jsonb)`,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			b.Fatal(err)
		}
	}
	cfg.Lease = 30 * time.Second
	l := idempotency.New(pool, cfg)
	b.Cleanup(l.Close)
	return &benchEnv{pool: pool, ledger: l, prefix: fmt.Sprintf("%d-", time.Now().UnixNano())}
}

// runAt runs op at parallelism 1 and 32 (sub-benchmarks p=1, p=32).
func runAt(b *testing.B, op func(ctx context.Context, key string) error) {
	for _, p := range []int{1, 32} {
		b.Run(fmt.Sprintf("p=%d", p), func(b *testing.B) {
			ctx := context.Background()
			if p == 1 {
				for b.Loop() {
					if err := op(ctx, benchKey("k")); err != nil {
						b.Fatal(err)
					}
				}
				return
			}
			b.SetParallelism(max(1, p/runtimeProcs())) // p goroutines in all
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := op(ctx, benchKey("k")); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

func BenchmarkBareTx(b *testing.B) {
	env := setupBench(b)
	runAt(b, func(ctx context.Context, key string) error {
		return pgx.BeginFunc(ctx, env.pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (key, amount) VALUES ($1, $2)`, key, 1)
			return err
		})
	})
}

func BenchmarkDoTx(b *testing.B) { benchDoTx(b, &idempotency.Config{}) }

// BenchmarkDoTxAlone is BenchmarkDoTx with each delivery in a transaction of its own.
func BenchmarkDoTxAlone(b *testing.B) { benchDoTx(b, &idempotency.Config{DisableGroupCommit: true}) }

func benchDoTx(b *testing.B, cfg *idempotency.Config) {
	env := setupBenchConfig(b, cfg)
	runAt(b, func(ctx context.Context, key string) error {
		_, err := env.ledger.DoTx(ctx, idempotency.Request{Key: env.prefix + key, TaskType: "bench"},
			func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
				_, err := tx.Exec(ctx, `INSERT INTO effects (key, amount) VALUES ($1, $2)`, key, 1)
				return nil, err
			})
		return err
	})
}

func BenchmarkTwoCommits(b *testing.B) {
	env := setupBench(b)
	runAt(b, func(ctx context.Context, key string) error {
		if _, err := env.pool.Exec(ctx, `INSERT INTO bare_jobs (key, status) VALUES ($1, 'in_progress')`, key); err != nil {
			return err
		}
		_, err := env.pool.Exec(ctx, `UPDATE bare_jobs SET status = 'completed', result = $2 WHERE key = $1`, key, nil)
		return err
	})
}

func BenchmarkDo(b *testing.B) { benchDo(b, &idempotency.Config{}) }

// BenchmarkDoAlone is BenchmarkDo with each claim and completion committed alone.
func BenchmarkDoAlone(b *testing.B) { benchDo(b, &idempotency.Config{DisableGroupCommit: true}) }

func benchDo(b *testing.B, cfg *idempotency.Config) {
	env := setupBenchConfig(b, cfg)
	runAt(b, func(ctx context.Context, key string) error {
		_, err := env.ledger.Do(ctx, idempotency.Request{Key: env.prefix + key, TaskType: "bench"},
			func(ctx context.Context) (json.RawMessage, error) { return nil, nil })
		return err
	})
}

func runtimeProcs() int { return runtime.GOMAXPROCS(0) }
