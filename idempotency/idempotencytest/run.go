package idempotencytest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/internal/asynqkeys"
	"github.com/idemq/idemq/idempotency/internal/claimctx"
	"github.com/idemq/idemq/idempotency/internal/testhook"
)

// point is where a plan steps into a delivery.
type point int

const (
	beforeEffect point = iota
	afterEffect
)

// action is what a plan does at a point.
type action int

const (
	none action = iota
	crash
	freeze
	failAfter // return a retryable error after the effect
)

// run is one schedule of one case.
type run struct {
	cfg   Config
	c     Case
	s     Schedule
	id    string
	queue string
	// lockPrefix prefixes the run's lock keys, so that the harness deletes only its own.
	lockPrefix string
	task       *asynq.Task // the case's task, as the application built it

	mu       sync.Mutex
	nproc    int
	procs    []*process
	log      []*delivery
	maxBatch int
	problems []string
	// plan: what to do at each point, once, on the first delivery that reaches it.
	plan map[point]action
	// zeroChecked: a transactional delivery's uncommitted effect was checked invisible.
	zeroChecked bool

	events chan event // crashes and freezes, as they happen

	fillers   int             // fillers enqueued (shared-batch)
	fillersOK map[string]bool // fillers that succeeded, by TaskID

	key        string   // the job's key, as its first claim saw it
	steps      []string // the steps the handler called on its first run that succeeded
	stepsKnown bool     // a delivery ran the handler to success: steps holds its steps

	// step is a step schedule's plan; nil for the other schedules.
	step        *stepPlan
	marks       []mark        // the counter at the step points of the first delivery
	held        *delivery     // the delivery DuplicateAfterStep holds between steps
	release     chan struct{} // closed to let the held delivery go on
	releaseOnce sync.Once
}

type event struct {
	p    *process
	what string
}

// delivery is one delivery of any task the run's processes handled.
type delivery struct {
	Delivery
	taskType string
	done     bool
	err      error
	cached   bool
	result   json.RawMessage
	resFence int64 // the fence of the claim that completed the answered result
	tx       bool  // the handler ran in a DoTx transaction

	steps       []string  // the steps it called, in order
	frozenAt    string    // the step StaleOwnerAfterStep froze it after
	afterFreeze *stepCall // its first step call after it resumed
}

func (r *run) problem(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.problems = append(r.problems, fmt.Sprintf(format, args...))
}

func (r *run) signal(p *process, what string) {
	select {
	case r.events <- event{p, what}:
	default:
	}
}

// take returns the plan's action at pt, once.
func (r *run) take(pt point) action {
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.plan[pt]
	delete(r.plan, pt)
	return a
}

// deliver handles one delivery on p, recording it.
func (r *run) deliver(ctx context.Context, p *process, mux *asynq.ServeMux, t *asynq.Task) error {
	d := &delivery{taskType: t.Type()}
	d.Process = p.name
	d.TaskID, _ = asynq.GetTaskID(ctx)
	d.Attempt, _ = asynq.GetRetryCount(ctx)
	d.Outcome = "running"
	ours := t.Type() == r.task.Type()
	if ours {
		r.mu.Lock()
		r.log = append(r.log, d)
		r.mu.Unlock()
		h := &hook{r: r, p: p, d: d}
		ctx = claimctx.WithStepHook(testhook.With(ctx, h), h)
	}
	err := mux.ProcessTask(ctx, t)
	r.mu.Lock()
	defer r.mu.Unlock()
	if !ours {
		if err == nil {
			if r.fillersOK == nil {
				r.fillersOK = map[string]bool{}
			}
			r.fillersOK[d.TaskID] = true
		}
		return err
	}
	d.done, d.err = true, err
	switch {
	case strings.HasPrefix(d.Outcome, "frozen"):
		if err != nil {
			d.Outcome += ": error: " + err.Error()
		}
	case err != nil:
		d.Outcome = "error: " + err.Error()
	case d.cached:
		d.Outcome = fmt.Sprintf("cached (fence %d)", d.resFence)
	default:
		d.Outcome = "ok"
	}
	return err
}

// hook is the run's testhook for one delivery.
type hook struct {
	r *run
	p *process
	d *delivery
}

func (h *hook) BeforeEffect(ctx context.Context, inTx bool) {
	key, fence, _ := idempotency.FromContext(ctx)
	h.r.mu.Lock()
	h.d.Fence, h.d.tx = fence, inTx
	if h.r.key == "" {
		h.r.key = key
	}
	h.r.mu.Unlock()
	if other, ok := claimKey(key, h.r.id); !ok {
		h.r.problem("the key %q is used by another running schedule (%s): build the job's key from the id Case.Task gets", key, other)
	}
	switch h.r.take(beforeEffect) {
	case crash:
		h.setOutcome("crashed before the effect")
		h.p.crash()
	case freeze:
		h.setOutcome("frozen past its lease, then resumed")
		h.p.freeze()
	}
}

func (h *hook) AfterEffect(ctx context.Context, inTx bool, out json.RawMessage, err error) (json.RawMessage, error) {
	if inTx && err == nil {
		h.r.checkUncommitted()
	}
	if err == nil {
		h.r.mu.Lock()
		if !h.r.stepsKnown {
			h.r.steps, h.r.stepsKnown = append([]string(nil), h.d.steps...), true
		}
		h.r.mu.Unlock()
		h.r.markEffects(h.d, "end", "", false)
	}
	switch h.r.take(afterEffect) {
	case crash:
		h.setOutcome("crashed after the effect")
		h.p.crash()
	case failAfter:
		return nil, errors.New("idempotencytest: a retryable error after the effect")
	}
	return out, err
}

func (h *hook) Answered(_ context.Context, res idempotency.Result) {
	h.r.mu.Lock()
	defer h.r.mu.Unlock()
	h.d.cached, h.d.result, h.d.resFence = res.Cached, res.Result, res.Fence
	h.d.Result = string(res.Result)
}

func (h *hook) setOutcome(o string) {
	h.r.mu.Lock()
	defer h.r.mu.Unlock()
	h.d.Outcome = o
}

// checkUncommitted counts the effects while a transactional handler's first run still
// holds its transaction open: what it wrote through tx is not visible yet, so the counter
// must say 0. More means the handler wrote outside its transaction (through the pool) or
// did external I/O, which a rollback cannot undo.
func (r *run) checkUncommitted() {
	r.mu.Lock()
	if r.zeroChecked {
		r.mu.Unlock()
		return
	}
	r.zeroChecked = true
	r.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	n, err := r.c.Effects(ctx, r.id)
	switch {
	case err != nil:
		r.problem("counting effects inside the first transactional run: %v", err)
	case n != 0:
		r.problem("a transactional handler's effect is visible before its transaction committed (counter %d inside the first run, want 0): it writes outside the transaction it was given (through the pool?) or does external I/O, which no rollback undoes", n)
	}
}

// enqueue publishes the case's task under taskID on the run's queue.
func (r *run) enqueue(ctx context.Context, taskID string) error {
	headers := map[string]string{}
	for k, v := range r.task.Headers() {
		headers[k] = v
	}
	if _, ok := idempotency.FirstEnqueued(headers); !ok {
		for k, v := range idempotency.FirstEnqueuedHeader(time.Now()) {
			headers[k] = v
		}
	}
	t := asynq.NewTaskWithHeaders(r.task.Type(), r.task.Payload(), headers)
	_, err := r.client().EnqueueContext(ctx, t, asynq.Queue(r.queue), asynq.TaskID(taskID), asynq.MaxRetry(50), asynq.Timeout(time.Minute))
	return err
}

func (r *run) client() *asynq.Client { return asynq.NewClientFromRedisClient(r.cfg.Redis) }

// waitFor polls cond until it holds or the schedule's time is up.
func (r *run) waitFor(ctx context.Context, what string, cond func() bool) error {
	for {
		r.mu.Lock()
		ok := cond()
		r.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("timed out waiting for %s", what)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// succeeded reports whether a delivery of taskID succeeded. The caller holds r.mu.
func (r *run) succeeded(taskID string) bool {
	for _, d := range r.log {
		if d.TaskID == taskID && d.done && d.err == nil {
			return true
		}
	}
	return false
}

// waitEvent waits for the next crash or freeze.
func (r *run) waitEvent(ctx context.Context, what string) (event, error) {
	select {
	case e := <-r.events:
		if e.what != what {
			return e, fmt.Errorf("wanted the worker %s, it %s", what, e.what)
		}
		return e, nil
	case <-ctx.Done():
		return event{}, fmt.Errorf("timed out waiting for a delivery to be %s", what)
	}
}

// verdict checks the counter and the answers after the schedule.
func (r *run) verdict(ctx context.Context, rep *Report) {
	n, err := r.c.Effects(ctx, r.id)
	if err != nil {
		r.problem("counting effects: %v", err)
	}
	rep.Effects = n
	r.mu.Lock()
	defer r.mu.Unlock()
	if err == nil && r.step != nil {
		r.stepVerdict(n)
	} else if err == nil && n != 1 {
		msg := fmt.Sprintf("the effect happened %d times, want exactly 1", n)
		if n > 1 && !r.anyTx() && (r.s == CrashAfterEffect || r.s == ErrorAfterEffect || r.s == StaleOwner || r.s == RedisLoss) {
			msg += "; a leased handler's effect ran again after its run was cut short: exactly-once then rests on the provider honouring the job's key — pass the key from idempotency.FromContext (never a fresh or random one) as the provider's idempotency key, and use a provider that honours it"
		}
		r.problems = append(r.problems, msg)
	}
	var first json.RawMessage
	var firstID string
	for _, d := range r.log {
		if !d.done || d.err != nil || d.taskType != r.task.Type() {
			continue
		}
		if first == nil && firstID == "" {
			first, firstID = d.result, d.TaskID
			continue
		}
		if !sameJSON(first, d.result) {
			r.problems = append(r.problems, fmt.Sprintf("deliveries answered different results: %s (task %s) and %s (task %s)", first, firstID, d.result, d.TaskID))
			break
		}
	}
	for _, d := range r.log {
		rep.Log = append(rep.Log, d.Delivery)
	}
	rep.Problems = append(rep.Problems, r.problems...)
	if r.step != nil {
		for i, p := range rep.Problems {
			rep.Problems[i] = r.step.describe() + ": " + p
		}
	}
	rep.MaxBatch = r.maxBatch
	rep.Steps, rep.stepsKnown = r.steps, r.stepsKnown
}

func (r *run) anyTx() bool {
	for _, d := range r.log {
		if d.tx {
			return true
		}
	}
	return false
}

func sameJSON(a, b json.RawMessage) bool {
	if len(a) == 0 || len(b) == 0 {
		return len(a) == len(b)
	}
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return string(a) == string(b)
	}
	return reflect.DeepEqual(x, y)
}

// cleanup ends the run's processes and deletes its queue and lock keys.
func (r *run) cleanup() {
	r.releaseHeld()
	r.mu.Lock()
	procs := r.procs
	r.mu.Unlock()
	for _, p := range procs {
		p.close()
	}
	r.deleteRedisState(context.Background())
	releaseKeys(r.id)
}

// deleteRedisState deletes asynq's keys of the run's queue and the run's lock keys, and
// nothing else.
func (r *run) deleteRedisState(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for _, pattern := range []string{asynqkeys.QueuePattern(r.queue), r.lockPrefix + "*"} {
		iter := r.cfg.Redis.Scan(ctx, 0, pattern, 500).Iterator()
		for iter.Next(ctx) {
			r.cfg.Redis.Del(ctx, iter.Val())
		}
	}
	r.cfg.Redis.SRem(ctx, asynqkeys.AllQueues, r.queue)
}
