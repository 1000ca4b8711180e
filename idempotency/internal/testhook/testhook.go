// Package testhook lets idempotencytest step into a delivery where a crash, a freeze or
// an error after the effect matters: just before the handler's effect and just after it.
// A context without a hook changes nothing.
package testhook

import (
	"context"
	"encoding/json"

	"github.com/idemq/idemq/idempotency"
)

// Hook is called by the middleware's handlers on the delivery's goroutine.
type Hook interface {
	// BeforeEffect runs after the claim, just before the handler; inTx: the handler
	// runs in the ledger's transaction (DoTx, DoSQLTx), not leased. It may never return
	// (a crash).
	BeforeEffect(ctx context.Context, inTx bool)
	// AfterEffect runs just after the handler returned out and err, before the
	// completion, and returns what the middleware goes on with. It may never return.
	AfterEffect(ctx context.Context, inTx bool, out json.RawMessage, err error) (json.RawMessage, error)
	// Answered runs with the ledger's answer to a delivery that succeeded.
	Answered(ctx context.Context, res idempotency.Result)
}

type key struct{}

// With returns ctx carrying h.
func With(ctx context.Context, h Hook) context.Context { return context.WithValue(ctx, key{}, h) }

// From returns the hook ctx carries, or nil.
func From(ctx context.Context) Hook {
	h, _ := ctx.Value(key{}).(Hook)
	return h
}

// Effect runs fn, the handler's effect, between h's BeforeEffect and AfterEffect when ctx
// carries a hook; inTx as for BeforeEffect.
func Effect(ctx context.Context, inTx bool, fn func() (json.RawMessage, error)) (json.RawMessage, error) {
	h := From(ctx)
	if h == nil {
		return fn()
	}
	h.BeforeEffect(ctx, inTx)
	out, err := fn()
	return h.AfterEffect(ctx, inTx, out, err)
}
