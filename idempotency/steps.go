package idempotency

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency/internal/claimctx"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// Limits of step names and of the keys of jobs that record steps.
const (
	// MaxStepName is the longest step name, in bytes.
	MaxStepName = 64
	// StepKeySeparator joins a job's key and a step's name in the step's key
	// (<job key>#s/<name>); '#' cannot appear in a job's key, so no step key is a job's.
	StepKeySeparator = "#s/"
	// MaxStepJobKeyBytes is the longest key of a job whose every step name fits: a step
	// key is at most MaxKeyBytes (255) bytes, so a job that records steps should keep its
	// key to 255 - 3 - 64 = 188 bytes. A longer key works with shorter step names; Step
	// checks each step key when it is called, and the outbox at enqueue for the steps a
	// job declares (outbox.Spec.Steps).
	MaxStepJobKeyBytes = MaxKeyBytes - len(StepKeySeparator) - MaxStepName
)

// Errors of recorded steps. Compare with errors.Is.
var (
	// ErrNoClaim means Step or StepTx was called with a context that carries no leased
	// claim: outside a Ledger.Do handler (or asynqmw's leased mode).
	ErrNoClaim = errors.New("idempotency: no leased claim in the context")
	// ErrStepInTx means Step or StepTx was called inside a DoTx handler: there the whole
	// job is one transaction, which commits or rolls back as one, so there is nothing to
	// record step by step. Write to the handler's pgx.Tx directly.
	ErrStepInTx = errors.New("idempotency: steps are not recorded inside DoTx: the whole job is one transaction")
	// ErrStepMismatch means a step was recorded by an earlier delivery of the job with
	// another input (StepInput) or at another position of the run. The returned error is
	// a *StepMismatchError.
	ErrStepMismatch = errors.New("idempotency: recorded step mismatch")
)

// StepMismatchError says which recorded step a call does not match. It wraps
// ErrStepMismatch and is permanent (IsPermanent): the handler is not deterministic, and
// running it again cannot help.
type StepMismatchError struct {
	Key  string // the job's key
	Step string // the step's name
	// Order is true when the step was recorded as the RecordedSeq-th step call of its run
	// and is now the Seq-th (both from 0): the steps were called in another order, or one
	// name was used twice. Otherwise the step was recorded with another input fingerprint.
	Order            bool
	Seq, RecordedSeq int
}

func (e *StepMismatchError) Error() string {
	if e.Order {
		return fmt.Sprintf("%v: key %q step %q was recorded as step call #%d of its run, now called as #%d: steps must be called in the same order, each name once, on every delivery",
			ErrStepMismatch, e.Key, e.Step, e.RecordedSeq, e.Seq)
	}
	return fmt.Sprintf("%v: key %q step %q was recorded with another input", ErrStepMismatch, e.Key, e.Step)
}

// Is reports whether target is ErrStepMismatch.
func (e *StepMismatchError) Is(target error) bool { return target == ErrStepMismatch }

// StepOption configures one Step or StepTx call.
type StepOption func(*stepOptions)

type stepOptions struct {
	input []byte // the input's fingerprint, nil for none
	err   error  // the input could not be fingerprinted
}

// StepInput sets the step's input fingerprint: sha256 of json.Marshal(v). A step recorded
// with another fingerprint makes the call fail with a *StepMismatchError instead of
// returning another input's result. A step recorded without a fingerprint, or a call
// without one, is not compared. A v that json.Marshal refuses makes the call fail.
func StepInput(v any) StepOption {
	return func(o *stepOptions) {
		b, err := json.Marshal(v)
		if err != nil {
			o.err = fmt.Errorf("idempotency: step input: %w", err)
			return
		}
		sum := sha256.Sum256(b)
		o.input = sum[:]
	}
}

// StepKey returns the key of job jobKey's step name, <jobKey>#s/<name>: what a step
// hands its provider as the idempotency key. It returns an error wrapping
// ErrInvalidRequest when name breaks the rule [a-z0-9_-]{1,64}, or wrapping ErrInvalidKey
// when the step key would be longer than MaxKeyBytes (see MaxStepJobKeyBytes).
func StepKey(jobKey, name string) (string, error) {
	if err := validateStepName(name); err != nil {
		return "", err
	}
	k := jobKey + StepKeySeparator + name
	if len(k) > MaxKeyBytes {
		return "", fmt.Errorf("%w: step key %q is %d bytes, must be at most %d (keep a job that records steps to %d bytes)",
			ErrInvalidKey, k, len(k), MaxKeyBytes, MaxStepJobKeyBytes)
	}
	return k, nil
}

func validateStepName(name string) error {
	ok := len(name) >= 1 && len(name) <= MaxStepName
	for i := 0; ok && i < len(name); i++ {
		c := name[i]
		ok = c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '-'
	}
	if !ok {
		return fmt.Errorf("%w: step name %q must match [a-z0-9_-]{1,%d}", ErrInvalidRequest, name, MaxStepName)
	}
	return nil
}

// Step runs fn, an external effect (a payment provider, an email), at most once per job
// and generation as far as the ledger can tell, and records its result: a later delivery
// of the job (a takeover after the lease lapsed, a retry after a failure) gets the
// recorded result back without running fn. ctx must be the context of a leased handler
// (Ledger.Do's fn, asynqmw's leased mode). fn gets the step key, <job key>#s/<name>
// (StepKey): hand it to the provider as its idempotency key.
//
// The result is recorded as JSON (json.Marshal) in one statement that also makes a fenced
// update of the job's row: only the claim that holds the key records a step. When it no
// longer does, Step returns an error wrapping ErrLeaseLost and the result is not recorded.
// Step returns the result as decoded from its JSON, on the first run as on later ones, so
// that both see the same value. When fn returns an error, nothing is recorded and Step
// returns the error as is: a later delivery runs fn again.
//
// Names follow [a-z0-9_-]{1,64}, and every delivery must call the job's steps in the same
// order, one name once, one after another (not from concurrent goroutines): each call's
// position in the run is recorded, and a recorded step met at another position fails with
// a *StepMismatchError, as does one recorded with another input (StepInput). A job's
// first delivery reads nothing: a step costs one round trip, its record. A delivery that
// resumes the job (or re-runs it) reads the steps recorded so far once, at its first
// Step or StepTx call.
//
// Errors: ErrNoClaim outside a leased handler; ErrStepInTx inside DoTx; ErrInvalidRequest
// for a bad name; ErrInvalidKey when the step key is too long; ErrStepMismatch. These are
// permanent (IsPermanent), as is a result that cannot be stored (too large, or holding
// what jsonb refuses).
//
// Honest limit, as for Do: if the process dies (or the record fails) after fn's effect
// happened but before it was recorded, a later delivery runs fn again with the same step
// key; exactly-once then rests on the provider honouring that key. StepTx has no such gap.
func Step[T any](ctx context.Context, name string, fn func(ctx context.Context, stepKey string) (T, error), opts ...StepOption) (T, error) {
	return hooked(ctx, name, false, func(h claimctx.StepHook) (T, bool, error) { return step(ctx, name, fn, opts, h) })
}

// hooked runs a step call, telling the test harness's hook (claimctx.StepHook), when ctx
// carries one, where the call begins and how it ended.
func hooked[T any](ctx context.Context, name string, inTx bool, call func(claimctx.StepHook) (T, bool, error)) (T, error) {
	h := claimctx.StepHookFrom(ctx)
	if h == nil {
		v, _, err := call(nil)
		return v, err
	}
	h.Begin(ctx, name, inTx)
	v, cached, err := call(h)
	h.Done(ctx, name, inTx, err == nil && !cached, cached, err)
	return v, err
}

// step is Step; cached reports a step that an earlier delivery recorded.
func step[T any](ctx context.Context, name string, fn func(ctx context.Context, stepKey string) (T, error), opts []StepOption, h claimctx.StepHook) (v T, cached bool, err error) {
	run, err := stepRunOf(ctx, name)
	if err != nil {
		return v, false, err
	}
	ctx, span := run.l.startSpan(ctx, "idemq.step", run.c.Key)
	call, done, err := run.begin(ctx, name, opts)
	defer func() { run.end(span, name, call, done, err) }()
	if err != nil || done != nil {
		v, err = decodeStep[T](run, name, done, err)
		return v, err == nil, err
	}
	if err := context.Cause(ctx); err != nil {
		return v, false, withLeaseLoss(err, ctx)
	}
	res, err := fn(ctx, call.stepKey)
	if err != nil {
		return v, false, err
	}
	b, p, err := run.params(call, res)
	if err != nil {
		return v, false, err
	}
	if h != nil {
		h.Effected(ctx, name, false)
	}
	// The effect happened: record it even when the delivery is being cancelled (a lost
	// lease refuses it anyway), bounded by the write timeout.
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), run.l.cfg.WriteTimeout)
	defer cancel()
	recorded, err := run.record(wctx, p)
	if err != nil {
		return v, false, asUnavailable(wctx, fmt.Errorf("idempotency: record step %q of %s: %w", name, run.c.Key, err))
	}
	if !recorded {
		return v, false, run.leaseLost(name)
	}
	v, err = recordedStep[T](run, call, b)
	return v, false, err
}

// stepsKey keys a leased delivery's stepRun in its handler's context.
type stepsKey struct{}

// inStepTxKey keys, in the context of a StepTx's fn, the step's name.
type inStepTxKey struct{}

// stepRun is what one leased delivery knows of its job's steps.
type stepRun struct {
	l *Ledger
	c *Claim

	mu     sync.Mutex
	calls  int                      // step calls so far in this delivery
	loaded bool                     // steps has been read
	steps  map[string]store.StepRow // the steps recorded for the claim's generation
}

// withSteps returns the handler context of c's delivery, able to record steps.
func (l *Ledger) withSteps(ctx context.Context, c *Claim) context.Context {
	return context.WithValue(ctx, stepsKey{}, &stepRun{l: l, c: c})
}

// stepCall is one Step or StepTx call: its position, key and input.
type stepCall struct {
	name, stepKey string
	seq           int
	input         []byte
}

// stepRunOf returns the step run of ctx's leased delivery, or why a step named name cannot
// be recorded there.
func stepRunOf(ctx context.Context, name string) (*stepRun, error) {
	if claimctx.InTx(ctx) {
		return nil, Permanent(fmt.Errorf("%w (step %q)", ErrStepInTx, name))
	}
	if outer, ok := ctx.Value(inStepTxKey{}).(string); ok {
		// Its record would wait for the row lock the outer StepTx holds until fn returns.
		return nil, Permanent(fmt.Errorf("idempotency: step %q called inside StepTx %q: steps do not nest in a StepTx", name, outer))
	}
	run, ok := ctx.Value(stepsKey{}).(*stepRun)
	if !ok {
		return nil, Permanent(fmt.Errorf("%w: step %q must run inside a leased handler (Ledger.Do)", ErrNoClaim, name))
	}
	return run, nil
}

// begin checks a step call and gives it its position in the run. done is the step's
// record when an earlier delivery recorded it (then fn must not run). call.name is ""
// when name is not a valid step name.
func (run *stepRun) begin(ctx context.Context, name string, opts []StepOption) (call stepCall, done *store.StepRow, err error) {
	if err := validateStepName(name); err != nil {
		return call, nil, Permanent(err)
	}
	call.name = name
	if call.stepKey, err = StepKey(run.c.Key, name); err != nil {
		return call, nil, Permanent(err)
	}
	var o stepOptions
	for _, opt := range opts {
		opt(&o)
	}
	if o.err != nil {
		return call, nil, Permanent(fmt.Errorf("step %q: %w", name, o.err))
	}
	call.input = o.input

	run.mu.Lock()
	defer run.mu.Unlock()
	call.seq = run.calls
	run.calls++
	if !run.loaded {
		// Steps are recorded only under a claim of the key, and a key's first claim
		// (Attempt 1: its row was just inserted) comes after none: only a delivery that
		// resumes the key, or re-runs it, has steps to read.
		var rows []store.StepRow
		if run.c.Attempt > 1 {
			if rows, err = store.ReadSteps(ctx, run.l.pool, run.c.Key, int32(run.c.Generation)); err != nil {
				return call, nil, asUnavailable(ctx, fmt.Errorf("idempotency: read steps of %s: %w", run.c.Key, err))
			}
		}
		run.steps = make(map[string]store.StepRow, len(rows))
		for _, r := range rows {
			run.steps[r.Step] = r
		}
		run.loaded = true
	}
	r, ok := run.steps[name]
	switch {
	case !ok:
		return call, nil, nil
	case int(r.Seq) != call.seq:
		return call, nil, Permanent(&StepMismatchError{Key: run.c.Key, Step: name, Order: true, Seq: call.seq, RecordedSeq: int(r.Seq)})
	case r.InputFingerprint != nil && call.input != nil && string(r.InputFingerprint) != string(call.input):
		return call, nil, Permanent(&StepMismatchError{Key: run.c.Key, Step: name, Seq: call.seq, RecordedSeq: int(r.Seq)})
	}
	return call, &r, nil
}

// end reports how the step call named name ended: to Config.ObserveStep (unless the name
// was not valid) and on its span. It is cached when done, an earlier delivery's record,
// answered it, else told by err.
func (run *stepRun) end(span trace.Span, name string, call stepCall, done *store.StepRow, err error) {
	outcome := stepOutcome(done != nil, err)
	if call.name != "" && run.l.cfg.ObserveStep != nil {
		run.l.cfg.ObserveStep(run.c.TaskType, call.name, outcome)
	}
	endStepSpan(span, run.c, name, call, done, outcome, err)
}

// stepOutcome tells how a step call ended from whether it found a record and its error.
func stepOutcome(cached bool, err error) StepOutcome {
	switch {
	case err == nil && cached:
		return StepCached
	case err == nil:
		return StepRan
	case errors.Is(err, ErrLeaseLost):
		return StepLeaseLost
	case errors.Is(err, ErrStepMismatch):
		return StepMismatch
	default:
		return StepError
	}
}

// decodeStep is a step call's answer when it did not run: its error, or the recorded
// result.
func decodeStep[T any](run *stepRun, name string, done *store.StepRow, err error) (T, error) {
	var v T
	if err != nil {
		return v, err
	}
	if done.Result != nil {
		if err := json.Unmarshal(done.Result, &v); err != nil {
			return v, Permanent(fmt.Errorf("idempotency: step %q of %s: decode its recorded result: %w", name, run.c.Key, err))
		}
	}
	return v, nil
}

// record writes an external step's record (RecordStep) after its effect happened. A
// failure that leaves the database out of reach (store.Unavailable: Postgres restarting,
// a connection lost or refused) is tried again, every 50 ms doubling up to 1 s, until ctx
// ends or the handler's self-fence deadline (LeaseDeadline) is near: an effect whose
// record is lost is an effect the next delivery repeats. A record whose commit answer was
// lost may have committed: the retry then finds the step's row (a unique violation),
// and the row tells whether it is this claim's.
func (run *stepRun) record(ctx context.Context, p store.StepParams) (bool, error) {
	deadline, fenced := LeaseDeadline(ctx)
	wait := 50 * time.Millisecond
	for retried := false; ; retried = true {
		recorded, err := run.l.writes.RecordStep(ctx, run.l.pool, p)
		switch {
		case err == nil:
			return recorded, nil
		case retried && store.IsCode(err, store.UniqueViolation):
			return run.recordedBefore(ctx, p, err)
		case !store.Unavailable(err), fenced && time.Now().Add(wait).After(deadline):
			return false, err
		}
		run.l.log.WarnContext(ctx, "idempotency: a step's record failed after its effect; trying again",
			"key", p.Key, "step", p.Step, "fence", p.Fence, "err", err)
		select {
		case <-ctx.Done():
			return false, err
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
	}
}

// recordedBefore decides a retried record that found the step's row: recorded when the
// row is this claim's (an earlier try committed, its answer lost), else err.
func (run *stepRun) recordedBefore(ctx context.Context, p store.StepParams, err error) (bool, error) {
	rows, rerr := store.ReadSteps(ctx, run.l.pool, p.Key, p.Generation)
	if rerr != nil {
		return false, fmt.Errorf("%w (then reading the step: %v)", err, rerr)
	}
	for _, r := range rows {
		if r.Step == p.Step && r.Fence == p.Fence && r.Seq == p.Seq {
			return true, nil
		}
	}
	return false, err
}

// holdParams are the parameters that identify run's claim for a step's fenced row lock.
func (run *stepRun) holdParams(call stepCall) store.StepParams {
	return store.StepParams{
		Key: run.c.Key, Fence: run.c.Fence, Owner: run.c.owner, Generation: int32(run.c.Generation),
		Step: call.name, Seq: int32(call.seq), InputFingerprint: call.input,
	}
}

// params encodes a step's result v and returns it with the step's record.
func (run *stepRun) params(call stepCall, v any) ([]byte, store.StepParams, error) {
	p := run.holdParams(call)
	b, err := json.Marshal(v)
	if err == nil {
		err = store.ValidateResult(b, run.l.cfg.MaxResultBytes)
	}
	if err != nil {
		return nil, p, Permanent(fmt.Errorf("idempotency: step %q of %s: its result cannot be stored: %w", call.name, run.c.Key, err))
	}
	p.Result = pgtype.Text{String: string(b), Valid: true}
	return b, p, nil
}

// recordedStep notes a step that this delivery just recorded, so that calling its name
// again in the run is refused, and returns its result decoded from b, its JSON.
func recordedStep[T any](run *stepRun, call stepCall, b []byte) (T, error) {
	r := store.StepRow{Step: call.name, Seq: int32(call.seq), Fence: run.c.Fence, InputFingerprint: call.input, Result: b}
	run.mu.Lock()
	run.steps[call.name] = r
	run.mu.Unlock()
	return decodeStep[T](run, call.name, &r, nil)
}

func (run *stepRun) leaseLost(name string) error {
	run.l.observe(EventLeaseLost, run.c.TaskType)
	run.l.recordClaim(HistoryLeaseLost, run.c, fmt.Sprintf("step %q not recorded", name))
	return fmt.Errorf("%w: key %q fence %d: step %q not recorded", ErrLeaseLost, run.c.Key, run.c.Fence, name)
}

// StepRecord is a recorded step, for operators (Ledger.Steps). Times are the database
// clock's.
type StepRecord struct {
	Name string
	// Seq is the step's position in its run (from 0): the order the steps were called.
	Seq int
	// Fence is the fence of the claim that recorded the step.
	Fence int64
	// Result is the step's result as JSON, nil when none was stored.
	Result json.RawMessage
	// InputFingerprint is the sha256 of the step's input (StepInput), nil when the step
	// was recorded without one.
	InputFingerprint []byte
	CreatedAt        time.Time
}

// Steps returns the steps recorded in key's current generation, in the order the run
// called them: none (and no error) when the ledger does not hold key or the generation
// recorded no step. It reads the steps and the generation in one statement. Safe for
// concurrent use.
func (l *Ledger) Steps(ctx context.Context, key string) ([]StepRecord, error) {
	rows, err := store.ShowSteps(ctx, l.pool, key)
	if err != nil {
		return nil, fmt.Errorf("idempotency: steps of %s: %w", key, err)
	}
	out := make([]StepRecord, 0, len(rows))
	for _, r := range rows {
		s := StepRecord{Name: r.Step, Seq: int(r.Seq), Fence: r.Fence, InputFingerprint: r.InputFingerprint, CreatedAt: r.CreatedAt}
		if r.Result != nil {
			s.Result = json.RawMessage(r.Result)
		}
		out = append(out, s)
	}
	return out, nil
}
