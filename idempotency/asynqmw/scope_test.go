package asynqmw_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
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

// scopeProcess is one worker process of a hot-scope test: its own Locker and Worker on
// the shared Redis and ledger, its charge handler, and its lock outcomes.
type scopeProcess struct {
	worker *asynqmw.Worker
	charge asynq.Handler
	mu     sync.Mutex
	events map[asynqmw.LockEvent]int
}

func (p *scopeProcess) count(ev asynqmw.LockEvent) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.events[ev]
}

// newScopeProcess returns a process whose charges run fn under the customer's lock.
func newScopeProcess(ledger *idempotency.Ledger, rdb *redis.Client, cfg asynqmw.Config, fn func(ctx context.Context, c tasks.Charge) error) *scopeProcess {
	p := &scopeProcess{events: map[asynqmw.LockEvent]int{}}
	cfg.ObserveLock = func(ev asynqmw.LockEvent, _ string) {
		p.mu.Lock()
		p.events[ev]++
		p.mu.Unlock()
	}
	p.worker = asynqmw.NewWorker(ledger, lock.New(rdb, nil), &cfg)
	p.charge = asynqmw.Leased(p.worker, tasks.TypeCharge, tasks.DecodeCharge, func(ctx context.Context, c tasks.Charge) (json.RawMessage, error) {
		return json.RawMessage(`{}`), fn(ctx, c)
	})
	return p
}

// enter counts a run in inside and keeps the most runs seen at once in most; the
// returned func ends the run.
func enter(inside, most *atomic.Int64) func() {
	n := inside.Add(1)
	for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
	}
	return func() { inside.Add(-1) }
}

// driveHot delivers n tasks (deliver(i, k) delivers the k-th on process i) from 8
// goroutines in each of procs processes, and reports every error.
func driveHot(t *testing.T, n, procs int, deliver func(i int, k int64) error) {
	t.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range procs {
		for range 8 {
			wg.Go(func() {
				for k := next.Add(1); k <= int64(n); k = next.Add(1) {
					if err := deliver(i, k); err != nil {
						errs <- fmt.Errorf("task %d on process %d: %w", k, i, err)
					}
				}
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func hotCharge(t *testing.T, order string) *asynq.Task {
	t.Helper()
	task, err := tasks.NewChargeTask(tasks.Charge{OrderID: order, CustomerID: "c-hot", AmountCents: 1, Currency: "EUR"})
	if err != nil {
		t.Fatal(err)
	}
	return task
}

// TestScopeHandoffAcrossProcesses: 100 deliveries of one customer over 3 processes, 8 at
// a time in each. They run one at a time, every one of them, none answered busy; within a
// process the held lock is handed from one delivery to the next, at most ScopeHandoffs
// times per obtain, and every process gets its turn.
func TestScopeHandoffAcrossProcesses(t *testing.T) {
	t.Parallel()
	ledger, _ := newLedger(t, &idempotency.Config{Lease: 10 * time.Second})
	ctx := testenv.Context(t, time.Minute)
	rdb := testenv.Redis(t)
	cfg := asynqmw.Config{ScopeHandoffs: 5, ScopeWait: 20 * time.Second}

	var inside, most, runs atomic.Int64
	var orderMu sync.Mutex
	var order []int // the process of each run, in order
	procs := make([]*scopeProcess, 3)
	for i := range procs {
		procs[i] = newScopeProcess(ledger, rdb, cfg, func(ctx context.Context, c tasks.Charge) error {
			defer enter(&inside, &most)()
			orderMu.Lock()
			order = append(order, i)
			orderMu.Unlock()
			runs.Add(1)
			time.Sleep(2 * time.Millisecond)
			return nil
		})
	}

	const n = 100
	driveHot(t, n, len(procs), func(i int, k int64) error {
		return procs[i].charge.ProcessTask(ctx, hotCharge(t, fmt.Sprintf("hot-%03d", k)))
	})
	if runs.Load() != n {
		t.Fatalf("%d runs, want %d", runs.Load(), n)
	}
	if most.Load() != 1 {
		t.Fatalf("%d deliveries of one customer ran at once, want 1", most.Load())
	}
	for i, p := range procs {
		obtained, handed, busy := p.count(asynqmw.LockObtained), p.count(asynqmw.LockHanded), p.count(asynqmw.LockBusy)
		t.Logf("process %d: obtained %d, handed %d, waited %d, busy %d", i, obtained, handed, p.count(asynqmw.LockWaited), busy)
		if busy != 0 {
			t.Errorf("process %d answered busy %d times", i, busy)
		}
		if obtained == 0 {
			t.Errorf("process %d never got the lock from Redis: no turn", i)
		}
		// Past the bound a holder hands on only when no other process asked meanwhile.
		if handed > cfg.ScopeHandoffs*obtained*3 {
			t.Errorf("process %d: %d handoffs for %d obtains; the bound is %d per obtain unless nobody else asked", i, handed, obtained, cfg.ScopeHandoffs)
		}
	}
	var handed int
	for _, p := range procs {
		handed += p.count(asynqmw.LockHanded)
	}
	if handed == 0 {
		t.Error("no lock was handed over: every delivery went to Redis")
	}
}

// TestScopeTurnEndsWhenAnotherProcessWaits: a process whose deliveries of one customer
// keep coming, with bounds that would let it keep the lock for a minute, hands the scope
// to another process that asks for it once the deliveries then in line are served, and
// the other process's deliveries run while the first one's keep coming.
func TestScopeTurnEndsWhenAnotherProcessWaits(t *testing.T) {
	t.Parallel()
	ledger, _ := newLedger(t, &idempotency.Config{Lease: 10 * time.Second})
	ctx := testenv.Context(t, time.Minute)
	rdb := testenv.Redis(t)
	cfg := asynqmw.Config{ScopeHold: time.Minute, ScopeHandoffs: 1 << 20, ScopeWait: 30 * time.Second, ScopeWaiters: 16}
	var inside, most atomic.Int64
	run := func(ctx context.Context, c tasks.Charge) error {
		defer enter(&inside, &most)()
		time.Sleep(2 * time.Millisecond)
		return nil
	}
	first, second := newScopeProcess(ledger, rdb, cfg, run), newScopeProcess(ledger, rdb, cfg, run)

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var next atomic.Int64
	for range 8 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := first.charge.ProcessTask(ctx, hotCharge(t, fmt.Sprintf("stream-%d", next.Add(1)))); err != nil {
					t.Errorf("the first process: %v", err)
					return
				}
			}
		})
	}
	waitFor(t, func() bool { return first.count(asynqmw.LockHanded) >= 20 })

	start := time.Now()
	for i := range 3 {
		if err := second.charge.ProcessTask(ctx, hotCharge(t, fmt.Sprintf("remote-%d", i))); err != nil {
			t.Errorf("the second process's delivery %d: %v", i, err)
			break
		}
	}
	took := time.Since(start)
	streamed := next.Load()
	close(stop)
	wg.Wait()
	t.Logf("the second process's 3 deliveries took %s; the first ran %d meanwhile", took, streamed)
	if took > 10*time.Second {
		t.Errorf("the second process waited %s for 3 turns: the first kept the scope", took)
	}
	if most.Load() != 1 {
		t.Errorf("%d deliveries of one customer ran at once, want 1", most.Load())
	}
	if busy := second.count(asynqmw.LockBusy); busy != 0 {
		t.Errorf("the second process answered busy %d times", busy)
	}
	if second.count(asynqmw.LockObtained) != 3 {
		t.Errorf("the second process obtained the lock %d times, want 3", second.count(asynqmw.LockObtained))
	}
}

// TestScopeWaitIsBounded: a delivery whose scope another process holds waits for it
// (and runs once it is released) instead of bouncing; past ScopeWait it answers busy. A
// full line of waiters answers busy at once, and so does every waiter after Stop.
func TestScopeWaitIsBounded(t *testing.T) {
	t.Parallel()
	ledger, _ := newLedger(t, &idempotency.Config{Lease: 10 * time.Second})
	ctx := testenv.Context(t, time.Minute)
	rdb := testenv.Redis(t)
	other := lock.New(rdb, nil)
	release := make(chan struct{})
	p := newScopeProcess(ledger, rdb, asynqmw.Config{ScopeWait: 400 * time.Millisecond, ScopeWaiters: 1},
		func(ctx context.Context, c tasks.Charge) error {
			if c.OrderID == "w-block" {
				<-release
			}
			return nil
		})

	// Held elsewhere for 150 ms: the delivery waits and runs.
	lk, err := other.Obtain(ctx, "customer:c-hot", 10*time.Second, nil)
	if err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(150*time.Millisecond, func() { lk.Release(context.Background()) })
	if err := p.charge.ProcessTask(ctx, hotCharge(t, "w-1")); err != nil {
		t.Fatalf("a scope released within ScopeWait: %v, want the delivery to run", err)
	}
	if p.count(asynqmw.LockWaited) != 1 {
		t.Errorf("waited %d times, want 1", p.count(asynqmw.LockWaited))
	}

	// Held elsewhere for longer: busy after about ScopeWait.
	lk, err = other.Obtain(ctx, "customer:c-hot", 10*time.Second, nil)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err = p.charge.ProcessTask(ctx, hotCharge(t, "w-2"))
	if took := time.Since(start); !errors.Is(err, asynqmw.ErrLockBusy) || took < 400*time.Millisecond || took > 5*time.Second {
		t.Fatalf("a scope held past ScopeWait: %v after %s, want ErrLockBusy after about 400ms", err, took)
	}
	lk.Release(ctx)

	// A holder in this process and one waiter (ScopeWaiters 1): the next answers busy at once.
	done := make(chan error, 2)
	go func() { done <- p.charge.ProcessTask(ctx, hotCharge(t, "w-block")) }()
	waitFor(t, func() bool { return p.count(asynqmw.LockObtained) == 2 })
	go func() { done <- p.charge.ProcessTask(ctx, hotCharge(t, "w-3")) }()
	time.Sleep(50 * time.Millisecond) // w-3 takes the one place in line
	start = time.Now()
	if err := p.charge.ProcessTask(ctx, hotCharge(t, "w-4")); !errors.Is(err, asynqmw.ErrLockBusy) || time.Since(start) > 200*time.Millisecond {
		t.Fatalf("a full line: %v after %s, want ErrLockBusy at once", err, time.Since(start))
	}
	// Stop: the waiter answers busy at once; the holder finishes.
	p.worker.Stop()
	select {
	case err := <-done:
		if !errors.Is(err, asynqmw.ErrLockBusy) {
			t.Fatalf("the waiter after Stop: %v, want ErrLockBusy", err)
		}
	case <-time.After(300 * time.Millisecond):
		t.Fatal("the waiter did not answer at once after Stop")
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatalf("the holder: %v", err)
	}
}

func waitFor(t *testing.T, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestScopeRidersAcrossProcesses: 100 transactional deliveries of one account over 3
// processes (each its own Ledger), 8 at a time in each. They run one at a time, across
// the processes as within each, none answered busy; within a process the deliveries that
// meet ride one turn of the lock and share transactions, and every process gets its turn.
func TestScopeRidersAcrossProcesses(t *testing.T) {
	t.Parallel()
	_, pool := newLedger(t, nil)
	ctx := testenv.Context(t, time.Minute)
	rdb := testenv.Redis(t)
	cfg := asynqmw.Config{ScopeHandoffs: 20, ScopeWait: 20 * time.Second}

	var inside, most, runs atomic.Int64
	type process struct {
		*scopeProcess
		debit  asynq.Handler
		shared atomic.Int64 // deliveries that shared a transaction
	}
	procs := make([]*process, 3)
	for i := range procs {
		p := &process{}
		ledger := idempotency.New(pool, &idempotency.Config{ObserveBatch: func(kind string, size int) {
			if kind == idempotency.BatchTx && size > 1 {
				p.shared.Add(int64(size))
			}
		}})
		t.Cleanup(ledger.Close)
		p.scopeProcess = newScopeProcess(ledger, rdb, cfg, func(context.Context, tasks.Charge) error { return nil })
		p.debit = asynqmw.Transactional(p.worker, tasks.TypeDebit, tasks.DecodeDebit, func(ctx context.Context, tx pgx.Tx, d tasks.Debit) (json.RawMessage, error) {
			defer enter(&inside, &most)()
			runs.Add(1)
			time.Sleep(time.Millisecond)
			_, err := tx.Exec(ctx, `SELECT 1`)
			return json.RawMessage(`{}`), err
		})
		procs[i] = p
	}

	const n = 100
	driveHot(t, n, len(procs), func(i int, k int64) error {
		task, err := tasks.NewDebitTask(tasks.Debit{AccountID: "a-hot", AmountCents: 1, Reference: fmt.Sprintf("hot-%03d", k)})
		if err != nil {
			return err
		}
		return procs[i].debit.ProcessTask(ctx, task)
	})
	if runs.Load() != n {
		t.Fatalf("%d runs, want %d", runs.Load(), n)
	}
	if most.Load() != 1 {
		t.Fatalf("%d debits of one account ran at once, want 1", most.Load())
	}
	var handed, shared int64
	for i, p := range procs {
		obtained, busy := p.count(asynqmw.LockObtained), p.count(asynqmw.LockBusy)
		t.Logf("process %d: obtained %d, handed %d, waited %d, busy %d, shared %d", i, obtained, p.count(asynqmw.LockHanded), p.count(asynqmw.LockWaited), busy, p.shared.Load())
		if busy != 0 {
			t.Errorf("process %d answered busy %d times", i, busy)
		}
		if obtained == 0 {
			t.Errorf("process %d never got the lock from Redis: no turn", i)
		}
		if h := p.count(asynqmw.LockHanded); h > cfg.ScopeHandoffs*obtained*3 {
			t.Errorf("process %d: %d turns joined or handed over for %d obtains; the bound is %d per obtain unless nobody else asked", i, h, obtained, cfg.ScopeHandoffs)
		}
		handed += int64(p.count(asynqmw.LockHanded))
		shared += p.shared.Load()
	}
	if handed == 0 || shared == 0 {
		t.Errorf("%d turns joined or handed over, %d debits shared a transaction: the riders never met", handed, shared)
	}
}

// TestLeasedScopeHandsOnBeforeCompletion: a leased delivery of a wider scope hands the
// scope on when its handler returns, so the scope's next delivery claims and runs while
// the first one's completion is still being written; their handlers never overlap. The
// first completion is held up by a row lock on its ledger row (each write commits on its
// own: group commit off), and the second handler must start meanwhile.
func TestLeasedScopeHandsOnBeforeCompletion(t *testing.T) {
	t.Parallel()
	ledger, pool := newLedger(t, &idempotency.Config{Lease: 10 * time.Second, DisableGroupCommit: true})
	ctx := testenv.Context(t, time.Minute)
	rdb := testenv.Redis(t)
	started := make(chan string, 2)
	firstGo := make(chan struct{})
	var inside, most atomic.Int64
	p := newScopeProcess(ledger, rdb, asynqmw.Config{ScopeWait: 20 * time.Second}, func(ctx context.Context, c tasks.Charge) error {
		defer enter(&inside, &most)()
		started <- c.OrderID
		if c.OrderID == "e-1" {
			<-firstGo
		}
		return nil
	})

	first := make(chan error, 1)
	go func() { first <- p.charge.ProcessTask(ctx, hotCharge(t, "e-1")) }()
	if got := <-started; got != "e-1" {
		t.Fatalf("first run: %s, want e-1", got)
	}
	// The first delivery's claim is committed and its handler runs: lock its row, so
	// that its completion waits.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if _, err := tx.Exec(ctx, `SELECT 1 FROM processed_jobs WHERE idempotency_key = 'charge:e-1' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	second := make(chan error, 1)
	go func() { second <- p.charge.ProcessTask(ctx, hotCharge(t, "e-2")) }()
	time.Sleep(50 * time.Millisecond) // the second delivery waits in line for the scope
	close(firstGo)

	select {
	case got := <-started:
		if got != "e-2" {
			t.Fatalf("second run: %s, want e-2", got)
		}
	case <-time.After(1500 * time.Millisecond): // within the completion's 2 s lock timeout
		t.Fatal("the scope's next delivery did not run while the first one's completion waited")
	}
	select {
	case err := <-first:
		t.Fatalf("the first delivery returned (%v) while its row was locked", err)
	default:
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-first; err != nil {
		t.Fatalf("first delivery: %v", err)
	}
	if err := <-second; err != nil {
		t.Fatalf("second delivery: %v", err)
	}
	if most.Load() != 1 {
		t.Fatalf("%d handlers of one customer ran at once, want 1", most.Load())
	}
	for _, key := range []string{"charge:e-1", "charge:e-2"} {
		if r := get(t, ledger, key); r.Status != idempotency.StatusCompleted {
			t.Errorf("%s: %s, want completed", key, r.Status)
		}
	}
	if got := p.count(asynqmw.LockHanded) + p.count(asynqmw.LockObtained); got != 2 {
		t.Errorf("%d turns (handed or obtained), want 2", got)
	}
}

// TestWaitReturnsOnceLocksAreReleased: a delivery returns without waiting for its lock's
// release; Worker.Wait returns only once the lock is gone from Redis.
func TestWaitReturnsOnceLocksAreReleased(t *testing.T) {
	t.Parallel()
	ledger, _ := newLedger(t, &idempotency.Config{Lease: 10 * time.Second})
	ctx := testenv.Context(t, time.Minute)
	rdb := testenv.Redis(t)
	// The lock's scripts (its release among them) take 30 ms more on the worker's client.
	opt := *rdb.Options()
	slow := redis.NewClient(&opt)
	t.Cleanup(func() { slow.Close() })
	slow.AddHook(slowScripts{30 * time.Millisecond})
	p := newScopeProcess(ledger, slow, asynqmw.Config{}, func(context.Context, tasks.Charge) error { return nil })
	for i := range 5 {
		if err := p.charge.ProcessTask(ctx, hotCharge(t, fmt.Sprintf("wait-%d", i))); err != nil {
			t.Fatal(err)
		}
		p.worker.Wait()
		if n := rdb.Exists(ctx, lock.New(rdb, nil).RedisKey("customer:c-hot")).Val(); n != 0 {
			t.Fatalf("delivery %d: the scope's lock is still in Redis after Wait", i)
		}
	}
	if got := p.count(asynqmw.LockObtained); got != 5 {
		t.Errorf("%d locks obtained from Redis, want 5 (each released before the next)", got)
	}
}

// slowScripts delays every script call, and every pipeline with one, by d.
type slowScripts struct{ d time.Duration }

func (h slowScripts) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h slowScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := cmd.Name(); name == "evalsha" || name == "eval" {
			time.Sleep(h.d)
		}
		return next(ctx, cmd)
	}
}

func (h slowScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if name := cmd.Name(); name == "evalsha" || name == "eval" {
				time.Sleep(h.d)
				break
			}
		}
		return next(ctx, cmds)
	}
}
