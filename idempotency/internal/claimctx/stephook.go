package claimctx

import "context"

// The step hook lets idempotencytest step into a recorded step (idempotency.Step and
// StepTx) where a crash, a freeze or a duplicate delivery matters: when the step is
// called, after its effect but before its record, and when it has ended. A context without
// a hook changes nothing and costs one context lookup per step call.

// StepHook is called by Step and StepTx on the calling goroutine.
type StepHook interface {
	// Begin runs when a step is called, before the recorded steps are consulted.
	Begin(ctx context.Context, name string, tx bool)
	// Effected runs when the step's fn returned without error, before its record: for a
	// Step before the record is written, for a StepTx inside its transaction before the
	// commit. It may never return (a crash).
	Effected(ctx context.Context, name string, tx bool)
	// Done runs when the step call ends: recorded reports that this call recorded the
	// step, cached that an earlier delivery had (fn did not run); err is the call's error.
	// It may block (a freeze, a pause).
	Done(ctx context.Context, name string, tx, recorded, cached bool, err error)
}

type stepHookKey struct{}

// WithStepHook returns ctx carrying h.
func WithStepHook(ctx context.Context, h StepHook) context.Context {
	return context.WithValue(ctx, stepHookKey{}, h)
}

// StepHookFrom returns the hook ctx carries, or nil.
func StepHookFrom(ctx context.Context) StepHook {
	h, _ := ctx.Value(stepHookKey{}).(StepHook)
	return h
}
