// Package claimctx carries what a handler's context carries for the library: the claim
// and the harness's step hook.
//
// The claim is the key and fence of the claim a handler runs under: the ledger sets them
// (and so do the unguarded handlers of the demo and the negative controls, with fence 0);
// idempotency.FromContext reads them. A DoTx handler's claim is marked as transactional
// (WithTx), which recorded steps refuse. The step hook (StepHook, stephook.go) is set by
// idempotencytest alone, to step into a recorded step.
package claimctx

import "context"

type ctxKey struct{}

type claim struct {
	key   string
	fence int64
	tx    bool
}

// With returns ctx carrying key and fence.
func With(ctx context.Context, key string, fence int64) context.Context {
	return context.WithValue(ctx, ctxKey{}, claim{key, fence, false})
}

// WithTx returns ctx carrying key and fence of a transactional (DoTx) claim.
func WithTx(ctx context.Context, key string, fence int64) context.Context {
	return context.WithValue(ctx, ctxKey{}, claim{key, fence, true})
}

// From returns the key and fence ctx carries; ok is false when it carries none.
func From(ctx context.Context) (key string, fence int64, ok bool) {
	c, ok := ctx.Value(ctxKey{}).(claim)
	return c.key, c.fence, ok
}

// InTx reports whether ctx carries a transactional (DoTx) claim.
func InTx(ctx context.Context) bool {
	c, ok := ctx.Value(ctxKey{}).(claim)
	return ok && c.tx
}
