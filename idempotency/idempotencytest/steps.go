package idempotencytest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency"
)

// The step schedules' names: a prefix, then the step's name.
const (
	crashAfterStepPrefix = "crash-after-step:"
	staleAfterStepPrefix = "stale-owner-after-step:"
	dupAfterStepPrefix   = "duplicate-after-step:"
)

// CrashAfterStep is the schedule that kills the worker process inside the job's step
// name, after its effect and before its record: for an idempotency.Step, fn returned and
// the record is never written; for a StepTx, its transaction never commits (the server
// rolls it back). Another process delivers the job again: it finds the steps before name
// recorded and runs name again. A Step's external effect then happens twice unless its
// provider honours the step key, which the case's counter shows.
func CrashAfterStep(name string) Schedule { return Schedule(crashAfterStepPrefix + name) }

// StaleOwnerAfterStep is the schedule that freezes the worker process just after the job's
// step name was recorded, past its lease; another process takes the job over and completes
// it; then the first resumes. Its next step must be refused (idempotency.ErrLeaseLost, or
// its context ended by the lease's loss) and record nothing.
func StaleOwnerAfterStep(name string) Schedule { return Schedule(staleAfterStepPrefix + name) }

// DuplicateAfterStep is the schedule that holds the first delivery just after the job's
// step name was recorded (its process alive, its lease heartbeated) while a second
// delivery of the job, under another TaskID, arrives on another process; once that one
// was answered, the first goes on. The duplicate must run no step's effect while the
// first holds the job, and both must answer the same result.
func DuplicateAfterStep(name string) Schedule { return Schedule(dupAfterStepPrefix + name) }

// StepSchedules returns the step schedules of a handler that calls the given steps, in
// order: for each step, CrashAfterStep, StaleOwnerAfterStep and DuplicateAfterStep.
func StepSchedules(steps ...string) []Schedule {
	var out []Schedule
	for _, s := range steps {
		out = append(out, CrashAfterStep(s), StaleOwnerAfterStep(s), DuplicateAfterStep(s))
	}
	return out
}

// stepAction is what a step schedule does at its step.
type stepAction int

const (
	stepCrash stepAction = iota + 1 // crash after the effect, before the record
	stepStale                       // freeze after the record, past the lease
	stepPause                       // hold the delivery after the record while a duplicate arrives
)

// stepPlan is a step schedule's plan: what to do, at which step, once.
type stepPlan struct {
	action stepAction
	step   string
	taken  bool
}

// parseStepSchedule returns the plan of a step schedule, or nil for another schedule.
func parseStepSchedule(s Schedule) *stepPlan {
	for prefix, a := range map[string]stepAction{crashAfterStepPrefix: stepCrash, staleAfterStepPrefix: stepStale, dupAfterStepPrefix: stepPause} {
		if name, ok := strings.CutPrefix(string(s), prefix); ok {
			return &stepPlan{action: a, step: name}
		}
	}
	return nil
}

// describe names the schedule's fault and its step, as its problems begin.
func (p *stepPlan) describe() string {
	switch p.action {
	case stepCrash:
		return fmt.Sprintf("crash after step %q effect, before its record", p.step)
	case stepStale:
		return fmt.Sprintf("stale owner after step %q", p.step)
	default:
		return fmt.Sprintf("duplicate delivery after step %q", p.step)
	}
}

// mark is the case's counter at one point of the first delivery of a step schedule.
type mark struct {
	at   string // "begin", "effected", "done" or "end" (the handler returned)
	step string // the step's name; "" at the end
	tx   bool   // the step is a StepTx
	n    int
}

// stepCall is one step call a delivery made, as its hook saw it.
type stepCall struct {
	name     string
	recorded bool
	err      error
}

// Begin notes the step call, and counts the effects on the first delivery of a step
// schedule.
func (h *hook) Begin(ctx context.Context, name string, tx bool) {
	h.r.mu.Lock()
	h.d.steps = append(h.d.steps, name)
	h.r.mu.Unlock()
	h.r.markEffects(h.d, "begin", name, tx)
}

// Effected runs the crash of CrashAfterStep, after the step's effect and before its record.
func (h *hook) Effected(ctx context.Context, name string, tx bool) {
	h.r.markEffects(h.d, "effected", name, tx)
	h.r.mu.Lock()
	if h.r.held != nil && h.r.held != h.d {
		h.r.problems = append(h.r.problems, fmt.Sprintf("a duplicate delivery (%s task %s) ran step %q's effect while the job's first delivery held it between steps", h.d.Process, h.d.TaskID, name))
	}
	if h.d.frozenAt != "" {
		h.r.problems = append(h.r.problems, fmt.Sprintf("the stale owner (fence %d) ran step %q's effect after its lease was taken over: the step ran on a context that outlives the lease (context.WithoutCancel?); give Step and StepTx the handler's context, which ends with the lease", h.d.Fence, name))
	}
	h.r.mu.Unlock()
	if h.r.takeStep(name, stepCrash) {
		h.setOutcome(fmt.Sprintf("crashed after step %q's effect, before its record", name))
		h.p.crash()
	}
}

// Done notes how the step call ended, and runs the freeze of StaleOwnerAfterStep or the
// hold of DuplicateAfterStep once the step was recorded.
func (h *hook) Done(ctx context.Context, name string, tx, recorded, cached bool, err error) {
	h.r.markEffects(h.d, "done", name, tx)
	h.r.mu.Lock()
	if h.d.frozenAt != "" && h.d.afterFreeze == nil {
		h.d.afterFreeze = &stepCall{name: name, recorded: recorded, err: err}
	}
	h.r.mu.Unlock()
	if !recorded {
		return
	}
	switch {
	case h.r.takeStep(name, stepStale):
		h.r.mu.Lock()
		h.d.frozenAt = name
		h.r.mu.Unlock()
		h.setOutcome(fmt.Sprintf("frozen after step %q past its lease, then resumed", name))
		h.p.freeze()
	case h.r.takeStep(name, stepPause):
		h.r.mu.Lock()
		h.r.held = h.d
		h.r.mu.Unlock()
		h.r.signal(h.p, "held")
		<-h.r.release
		h.r.mu.Lock()
		h.r.held = nil
		h.r.mu.Unlock()
	}
}

// takeStep reports, once, whether the run's step plan does a at step name.
func (r *run) takeStep(name string, a stepAction) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	p := r.step
	if p == nil || p.taken || p.action != a || p.step != name {
		return false
	}
	p.taken = true
	return true
}

// releaseHeld lets a held delivery go on; it is safe to call more than once.
func (r *run) releaseHeld() { r.releaseOnce.Do(func() { close(r.release) }) }

// markEffects counts the case's effects at a point of the first delivery of a step
// schedule, to tell which step (or no step) an effect that happened twice belongs to.
func (r *run) markEffects(d *delivery, at, step string, tx bool) {
	r.mu.Lock()
	// Past the plan's freeze or hold, other deliveries' effects would show in the marks.
	first := r.step != nil && (!r.step.taken || r.step.action == stepCrash) && len(r.log) > 0 && r.log[0] == d
	r.mu.Unlock()
	if !first {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), r.cfg.Timeout)
	defer cancel()
	n, err := r.c.Effects(ctx, r.id)
	if err != nil {
		r.problem("counting effects at step %q: %v", step, err)
		return
	}
	r.mu.Lock()
	r.marks = append(r.marks, mark{at: at, step: step, tx: tx, n: n})
	r.mu.Unlock()
}

// attribute says where the first delivery's effect happened, from its marks: in which
// step, or outside every step, and what that means for an effect that happened twice. It
// returns "" when the marks do not show it; uncommitted reports an effect of a StepTx
// visible before its transaction committed. The caller holds r.mu.
func (r *run) attribute() (why string, uncommitted bool) {
	prev, last := 0, ""
	for _, m := range r.marks {
		if m.n > prev {
			switch {
			case m.at == "begin" && last == "":
				return fmt.Sprintf("the effect happened outside any step, before step %q: a delivery that resumes the job runs it again — do it in a Step (an external effect, under its step key) or a StepTx (a database effect)", m.step), false
			case m.at == "begin" || m.at == "end":
				return fmt.Sprintf("the effect happened outside any step, after step %q: a delivery that resumes the job runs it again — do it in a Step (an external effect, under its step key) or a StepTx (a database effect)", last), false
			case m.tx && m.at == "effected":
				return fmt.Sprintf("the effect of StepTx %q was visible before its transaction committed: it is written outside the transaction StepTx gives (through the pool?) or is external I/O, which no rollback undoes", m.step), true
			case m.tx:
				return fmt.Sprintf("the effect is StepTx %q's, committed with its record", m.step), false
			default:
				return fmt.Sprintf("the effect is Step %q's: a Step's effect runs again after a crash between its effect and its record, so exactly-once rests on the provider honouring the step key — pass the stepKey Step's fn gets (never a fresh or random one) as the provider's idempotency key, and use a provider that honours it; a database effect belongs in StepTx, whose record commits with it", m.step), false
			}
		}
		prev, last = m.n, m.step
	}
	return "", false
}

// stepVerdict is the verdict's count check on a step schedule. A StepTx whose effect is
// visible before its commit is a problem even when a provider's key kept the count at 1:
// StepTx's fn must do no external I/O. The caller holds r.mu.
func (r *run) stepVerdict(n int) {
	why, uncommitted := r.attribute()
	switch {
	case n == 1 && uncommitted:
		r.problems = append(r.problems, why)
	case n > 1 && why != "":
		r.problems = append(r.problems, fmt.Sprintf("effect %q happened %d times, want exactly 1; %s", r.c.Name, n, why))
	case n != 1:
		r.problems = append(r.problems, fmt.Sprintf("effect %q happened %d times, want exactly 1", r.c.Name, n))
	}
}

// crashAfterStep kills the process of the first delivery after the step's effect, before
// its record; another process delivers the job again.
func (r *run) crashAfterStep(ctx context.Context) error {
	if _, err := r.startProcess(2); err != nil {
		return err
	}
	if err := r.enqueue(ctx, r.tid(1)); err != nil {
		return err
	}
	if _, err := r.waitStep(ctx, "crashed"); err != nil {
		return err
	}
	if _, err := r.startProcess(2); err != nil {
		return err
	}
	return r.waitFor(ctx, "the job to succeed after the crash", func() bool { return r.succeeded(r.tid(1)) })
}

// staleAfterStep freezes the process of the first delivery after the step was recorded;
// another process takes the job over and completes it; then the first resumes and must be
// refused at its next step, recording nothing.
func (r *run) staleAfterStep(ctx context.Context) error {
	p1, err := r.startProcess(2)
	if err != nil {
		return err
	}
	if err := r.enqueue(ctx, r.tid(1)); err != nil {
		return err
	}
	if _, err := r.waitStep(ctx, "frozen"); err != nil {
		return err
	}
	p2, err := r.startProcess(2)
	if err != nil {
		return err
	}
	if err := r.deliverAndWait(ctx, r.tid(2)); err != nil {
		p1.gate.resume()
		return err
	}
	p1.gate.resume()
	err = r.waitFor(ctx, "the frozen delivery to end and its task to succeed", func() bool {
		for _, d := range r.log {
			if d.Process == p1.name && !d.done {
				return false
			}
		}
		return r.succeeded(r.tid(1))
	})
	if err != nil {
		return err
	}
	r.checkStale(ctx, p2)
	return nil
}

// checkStale checks that the resumed stale owner was refused at its next step and that
// the ledger holds no step recorded under its fence after the freeze.
func (r *run) checkStale(ctx context.Context, live *process) {
	r.mu.Lock()
	var stale delivery
	for _, d := range r.log {
		if d.frozenAt != "" {
			stale = *d
		}
	}
	key := r.key
	r.mu.Unlock()
	if stale.frozenAt == "" {
		return
	}
	if c := stale.afterFreeze; c != nil {
		switch {
		case c.recorded:
			r.problem("the stale owner (fence %d) recorded step %q after its lease was taken over", stale.Fence, c.name)
		case c.err == nil:
			r.problem("the stale owner (fence %d) was not refused at step %q after its lease was taken over", stale.Fence, c.name)
		case !errors.Is(c.err, idempotency.ErrLeaseLost) && !errors.Is(c.err, context.Canceled) && !errors.Is(c.err, context.DeadlineExceeded):
			r.problem("the stale owner (fence %d) was refused at step %q with %v, want idempotency.ErrLeaseLost", stale.Fence, c.name, c.err)
		}
	}
	recs, err := live.ledger.Steps(ctx, key)
	if err != nil {
		r.problem("reading the recorded steps of %s: %v", key, err)
		return
	}
	before := map[string]bool{}
	for _, name := range stale.steps {
		before[name] = true
		if name == stale.frozenAt {
			break
		}
	}
	for _, rec := range recs {
		if rec.Fence == stale.Fence && !before[rec.Name] {
			r.problem("step %q is recorded under the stale owner's fence %d, after its lease was taken over", rec.Name, stale.Fence)
		}
	}
}

// dupAfterStep holds the first delivery after the step was recorded while a duplicate
// arrives on another process and is answered; then the first goes on.
func (r *run) dupAfterStep(ctx context.Context) error {
	if _, err := r.startProcess(2); err != nil {
		return err
	}
	if err := r.enqueue(ctx, r.tid(1)); err != nil {
		return err
	}
	if _, err := r.waitStep(ctx, "held"); err != nil {
		return err
	}
	if _, err := r.startProcess(2); err != nil {
		r.releaseHeld()
		return err
	}
	if err := r.enqueue(ctx, r.tid(2)); err != nil {
		r.releaseHeld()
		return err
	}
	err := r.waitFor(ctx, "the duplicate's first delivery to be answered", func() bool {
		for _, d := range r.log {
			if d.TaskID == r.tid(2) && d.done {
				return true
			}
		}
		return false
	})
	r.releaseHeld()
	if err != nil {
		return err
	}
	return r.waitFor(ctx, "both deliveries to succeed", func() bool { return r.succeeded(r.tid(1)) && r.succeeded(r.tid(2)) })
}

// waitStep waits for the step plan's event; it fails when the job succeeded first, its
// handler never having called the plan's step.
func (r *run) waitStep(ctx context.Context, what string) (event, error) {
	for {
		select {
		case e := <-r.events:
			if e.what != what {
				return e, fmt.Errorf("wanted the worker %s, it %s", what, e.what)
			}
			return e, nil
		case <-ctx.Done():
			return event{}, fmt.Errorf("timed out waiting for a delivery to be %s at step %q", what, r.step.step)
		case <-time.After(20 * time.Millisecond):
		}
		r.mu.Lock()
		ok, steps := r.succeeded(r.tid(1)), r.steps
		r.mu.Unlock()
		if ok {
			return event{}, fmt.Errorf("the job succeeded without a step %q (the steps its handler called: %q)", r.step.step, steps)
		}
	}
}

// runFindingSteps runs SequentialDuplicate as c's first subtest and returns the case's
// other schedules, with the step schedules of the steps that schedule saw the handler
// call. When a -run filter leaves SequentialDuplicate out, it runs the handler once, outside
// any subtest, to find them.
func runFindingSteps(t *testing.T, cfg Config, c Case) []Schedule {
	t.Helper()
	var rep *Report
	t.Run(string(SequentialDuplicate), func(t *testing.T) { rep = check(t, cfg, c, SequentialDuplicate) })
	if rep == nil {
		rep, _ = Verify(context.Background(), cfg, c, SequentialDuplicate)
	}
	var out []Schedule
	for _, s := range Schedules() {
		if s != SequentialDuplicate {
			out = append(out, s)
		}
	}
	switch {
	case rep == nil || !rep.stepsKnown:
		t.Logf("%s: no delivery ran the handler to success, so the step schedules do not run", c.Name)
	case len(rep.Steps) > 0:
		t.Logf("%s: the handler calls steps %q", c.Name, rep.Steps)
		out = append(out, StepSchedules(rep.Steps...)...)
	}
	return out
}
