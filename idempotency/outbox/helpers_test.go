package outbox_test

import (
	"context"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/internal/testledger"
)

// Shared helpers, under the names these tests use.
var (
	newLedger = testledger.New
	mustExec  = testenv.Exec
	count     = testenv.Count
)

// runRelay runs c's relay until the returned function is called, which stops it and waits
// for it to return.
func runRelay(ctx context.Context, c *outbox.Client) (stop func()) {
	relayCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.RunRelay(relayCtx)
	}()
	return func() { cancel(); <-done }
}
