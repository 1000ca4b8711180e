package idempotencytest

import (
	"context"
	"fmt"
	"time"

	"github.com/idemq/idemq/idempotency"
)

// Verify runs c under schedule s and returns what it saw. The error is for a harness
// that could not run the schedule (set-up, a timeout); what breaks exactly-once is in
// the report's Problems.
func Verify(ctx context.Context, cfg Config, c Case, s Schedule) (*Report, error) {
	cfg = cfg.withDefaults()
	if cfg.Pool == nil || cfg.Redis == nil || cfg.Handlers == nil && cfg.Register == nil || c.Task == nil || c.Effects == nil {
		return nil, fmt.Errorf("Config.Pool, Config.Redis, Config.Handlers (or Register), Case.Task and Case.Effects are required")
	}
	r := &run{cfg: cfg, c: c, s: s, id: newID(), plan: map[point]action{}, events: make(chan event, 4), release: make(chan struct{})}
	if r.step = parseStepSchedule(s); r.step != nil {
		if _, err := idempotency.StepKey("k", r.step.step); err != nil {
			return nil, fmt.Errorf("schedule %q: %w", s, err)
		}
	}
	r.queue = "idemqtest-" + r.id
	r.lockPrefix = "idemqtest:" + r.id + ":"
	task, err := c.Task(r.id)
	if err != nil {
		return nil, fmt.Errorf("Case.Task: %w", err)
	}
	r.task = task
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	defer r.cleanup()

	rep := &Report{Schedule: s}
	if err := r.schedule(ctx); err != nil {
		r.problem("%v", err)
	}
	r.verdict(context.WithoutCancel(ctx), rep)
	rep.Took = time.Since(start)
	return rep, nil
}

// tid is the run's TaskID number n.
func (r *run) tid(n int) string { return fmt.Sprintf("%s-%d", r.id, n) }

func (r *run) schedule(ctx context.Context) error {
	switch r.s {
	case ConcurrentDuplicates:
		return r.concurrentDuplicates(ctx)
	case SequentialDuplicate:
		return r.sequentialDuplicate(ctx)
	case CrashBeforeEffect:
		return r.crashAt(ctx, beforeEffect, false)
	case CrashAfterEffect:
		return r.crashAt(ctx, afterEffect, false)
	case RedisLoss:
		return r.crashAt(ctx, afterEffect, true)
	case StaleOwner:
		return r.staleOwner(ctx)
	case ErrorAfterEffect:
		return r.errorAfterEffect(ctx)
	case SharedBatch:
		return r.sharedBatch(ctx)
	}
	if r.step != nil {
		switch r.step.action {
		case stepCrash:
			return r.crashAfterStep(ctx)
		case stepStale:
			return r.staleAfterStep(ctx)
		case stepPause:
			return r.dupAfterStep(ctx)
		}
	}
	return fmt.Errorf("unknown schedule %q", r.s)
}

// deliverAndWait enqueues the case's task under each TaskID and waits until every one
// of them had a delivery that succeeded.
func (r *run) deliverAndWait(ctx context.Context, ids ...string) error {
	for _, id := range ids {
		if err := r.enqueue(ctx, id); err != nil {
			return err
		}
	}
	return r.waitFor(ctx, fmt.Sprintf("tasks %v to succeed", ids), func() bool {
		for _, id := range ids {
			if !r.succeeded(id) {
				return false
			}
		}
		return true
	})
}

func (r *run) concurrentDuplicates(ctx context.Context) error {
	for range 2 {
		if _, err := r.startProcess(4); err != nil {
			return err
		}
	}
	return r.deliverAndWait(ctx, r.tid(1), r.tid(2), r.tid(3), r.tid(4))
}

func (r *run) sequentialDuplicate(ctx context.Context) error {
	if _, err := r.startProcess(2); err != nil {
		return err
	}
	if err := r.deliverAndWait(ctx, r.tid(1)); err != nil {
		return err
	}
	if err := r.deliverAndWait(ctx, r.tid(2)); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, d := range r.log {
		if d.TaskID == r.tid(2) && d.done && d.err == nil && !d.cached {
			r.problems = append(r.problems, "the duplicate after completion was not answered from the ledger (not cached)")
		}
	}
	return nil
}

// crashAt kills the process that runs the first delivery at pt; another process delivers
// the job again. With lose, Redis then loses asynq's copy of the task and the lock, and
// the job is published again under a new TaskID, as the outbox reconciler does.
func (r *run) crashAt(ctx context.Context, pt point, lose bool) error {
	r.plan[pt] = crash
	p1, err := r.startProcess(2)
	if err != nil {
		return err
	}
	if err := r.enqueue(ctx, r.tid(1)); err != nil {
		return err
	}
	if _, err := r.waitEvent(ctx, "crashed"); err != nil {
		return err
	}
	r.checkRolledBack(ctx)
	id := r.tid(1)
	if lose {
		select { // asynq has handed the task back: now Redis loses it, and the lock
		case <-p1.down:
		case <-ctx.Done():
			return fmt.Errorf("timed out waiting for the crashed worker's asynq to stop")
		}
		r.deleteRedisState(ctx)
		id = r.tid(2)
		if err := r.enqueue(ctx, id); err != nil {
			return err
		}
	}
	if _, err := r.startProcess(2); err != nil {
		return err
	}
	return r.waitFor(ctx, "the job to succeed after the crash", func() bool { return r.succeeded(id) })
}

// checkRolledBack checks, after a crash inside a transactional delivery, that its effect
// went with its transaction: the counter says 0 again.
func (r *run) checkRolledBack(ctx context.Context) {
	r.mu.Lock()
	tx := r.anyTx()
	r.mu.Unlock()
	if !tx {
		return
	}
	n, err := r.c.Effects(ctx, r.id)
	if err == nil && n != 0 {
		r.problem("after a crash inside the transactional handler the counter says %d, want 0: the effect outlived its transaction's rollback (written outside the transaction, or external I/O)", n)
	}
}

func (r *run) staleOwner(ctx context.Context) error {
	r.plan[beforeEffect] = freeze
	p1, err := r.startProcess(2)
	if err != nil {
		return err
	}
	if err := r.enqueue(ctx, r.tid(1)); err != nil {
		return err
	}
	if _, err := r.waitEvent(ctx, "frozen"); err != nil {
		return err
	}
	if _, err := r.startProcess(2); err != nil {
		return err
	}
	// Another delivery takes over once the frozen one's lock and lease (or, for a
	// transactional one, its session's idle timeout) ran out.
	if err := r.deliverAndWait(ctx, r.tid(2)); err != nil {
		p1.gate.resume()
		return err
	}
	p1.gate.resume()
	return r.waitFor(ctx, "the frozen delivery to end and its task to succeed", func() bool {
		for _, d := range r.log {
			if d.Process == p1.name && !d.done {
				return false
			}
		}
		return r.succeeded(r.tid(1))
	})
}

func (r *run) errorAfterEffect(ctx context.Context) error {
	r.plan[afterEffect] = failAfter
	if _, err := r.startProcess(2); err != nil {
		return err
	}
	return r.deliverAndWait(ctx, r.tid(1))
}

func (r *run) sharedBatch(ctx context.Context) error {
	if _, err := r.startProcess(8); err != nil {
		return err
	}
	if err := r.enqueueFillers(ctx); err != nil {
		return err
	}
	if err := r.deliverAndWait(ctx, r.tid(1), r.tid(2), r.tid(3)); err != nil {
		return err
	}
	return r.waitFillers(ctx)
}
