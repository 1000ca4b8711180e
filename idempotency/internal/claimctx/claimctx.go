// Package claimctx carries the key and fence of the claim a handler runs under in its
// context: the ledger sets them (and so do the unguarded handlers of the demo and the
// negative controls, with fence 0); idempotency.FromContext reads them.
package claimctx

import "context"

type ctxKey struct{}

type claim struct {
	key   string
	fence int64
}

// With returns ctx carrying key and fence.
func With(ctx context.Context, key string, fence int64) context.Context {
	return context.WithValue(ctx, ctxKey{}, claim{key, fence})
}

// From returns the key and fence ctx carries; ok is false when it carries none.
func From(ctx context.Context) (key string, fence int64, ok bool) {
	c, ok := ctx.Value(ctxKey{}).(claim)
	return c.key, c.fence, ok
}
