package asynqmw_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/lock"
	"github.com/idemq/idemq/tasks"
)

// commandLog counts, by name, the commands a client sends alone and in pipelines, and the
// pipelines.
type commandLog struct {
	mu        sync.Mutex
	single    map[string]int
	piped     map[string]int
	pipelines int
}

func (l *commandLog) DialHook(next redis.DialHook) redis.DialHook { return next }

func (l *commandLog) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		l.mu.Lock()
		l.single[cmd.Name()]++
		l.mu.Unlock()
		return next(ctx, cmd)
	}
}

func (l *commandLog) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		l.mu.Lock()
		l.pipelines++
		for _, cmd := range cmds {
			l.piped[cmd.Name()]++
		}
		l.mu.Unlock()
		return next(ctx, cmds)
	}
}

// TestScopeLocksShareRoundTrips: 60 debits of 60 accounts delivered 10 at a time. Their
// locks are obtained in shared pipelines (fewer than the deliveries), and each lock's
// release goes with the result's write as one script call; every result is in asynq and
// every lock is gone once Wait returns. No lock command goes alone.
func TestScopeLocksShareRoundTrips(t *testing.T) {
	t.Parallel()
	ledger, _ := newLedger(t, &idempotency.Config{Lease: 10 * time.Second})
	ctx := testenv.Context(t, time.Minute)
	rdb := testenv.Redis(t)
	opt := *rdb.Options()
	worker := redis.NewClient(&opt) // the worker's locks and result writes, counted
	t.Cleanup(func() { worker.Close() })
	cmds := &commandLog{single: map[string]int{}, piped: map[string]int{}}
	worker.AddHook(cmds)
	w := asynqmw.NewWorker(ledger, lock.New(worker, nil), &asynqmw.Config{Redis: worker})
	mux := asynq.NewServeMux()
	mux.Handle(tasks.TypeDebit, asynqmw.Transactional(w, tasks.TypeDebit, tasks.DecodeDebit, debitResult))

	const n = 60
	client := asynq.NewClientFromRedisClient(rdb)
	for i := range n {
		task, err := tasks.NewDebitTask(tasks.Debit{AccountID: fmt.Sprintf("a-%d", i), AmountCents: 1, Reference: fmt.Sprintf("r-%d", i)})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := client.Enqueue(task, asynq.Retention(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	cfg := asynq.Config{Concurrency: 10, LogLevel: asynq.FatalLevel}
	asynqmw.Configure(&cfg)
	srv := asynq.NewServerFromRedisClient(rdb, cfg)
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	for done := 0; done < n; {
		if ctx.Err() != nil {
			t.Fatalf("%d of %d debits completed", done, n)
		}
		time.Sleep(50 * time.Millisecond)
		done = 0
		for i := range n {
			if info, err := insp.GetTaskInfo(tasks.Queue, fmt.Sprintf("debit:r-%d", i)); err == nil && info.State == asynq.TaskStateCompleted {
				if want := fmt.Sprintf(`{"debit":"r-%d"}`, i); string(info.Result) != want {
					t.Fatalf("debit %d: result %q in asynq, want %q", i, info.Result, want)
				}
				done++
			}
		}
	}
	srv.Shutdown()
	w.Wait()
	if keys := rdb.Keys(ctx, lock.DefaultPrefix+"*").Val(); len(keys) != 0 {
		t.Errorf("locks left in Redis after Wait: %v", keys)
	}
	cmds.mu.Lock()
	defer cmds.mu.Unlock()
	t.Logf("alone: %v; in %d pipelines: %v", cmds.single, cmds.pipelines, cmds.piped)
	for _, name := range []string{"set", "evalsha", "eval"} {
		if cmds.single[name] != 0 {
			t.Errorf("%d %s commands sent alone, want every lock command in a pipeline", cmds.single[name], name)
		}
	}
	if got := cmds.piped["set"]; got != n {
		t.Errorf("%d SETs for %d locks", got, n)
	}
	// One each, and those of the first pipeline again when Redis did not know the script.
	if got := cmds.piped["evalsha"] + cmds.piped["eval"]; got < n || got > n+n/4 {
		t.Errorf("%d script calls for %d releases with their result writes, want one each", got, n)
	}
	if cmds.pipelines >= 2*n {
		t.Errorf("%d pipelines for %d deliveries, want the deliveries' obtains and releases to share them", cmds.pipelines, n)
	}
}

func debitResult(_ context.Context, _ pgx.Tx, d tasks.Debit) (json.RawMessage, error) {
	return json.RawMessage(`{"debit":"` + d.Reference + `"}`), nil
}
