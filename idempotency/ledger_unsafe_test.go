package idempotency_test

import (
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// TestUnsafeNoFencingLetsAStaleOwnerWrite is the ledger-level negative control: with
// fencing off, the stale owner's heartbeat and completion go through.
func TestUnsafeNoFencingLetsAStaleOwnerWrite(t *testing.T) {
	t.Parallel()
	for _, unsafe := range []bool{false, true} {
		l, _ := newLedger(t, &idempotency.Config{Lease: 200 * time.Millisecond, UnsafeNoFencing: unsafe})
		ctx := testenv.Context(t, 30*time.Second)
		first, err := l.Claim(ctx, req("k"))
		if err != nil || first.Claim == nil {
			t.Fatal(first, err)
		}
		time.Sleep(300 * time.Millisecond)
		second, err := l.Claim(ctx, req("k"))
		if err != nil || second.Claim == nil {
			t.Fatal(second, err)
		}
		_, hbErr := l.Heartbeat(ctx, first.Claim)
		cErr := l.Complete(ctx, first.Claim, json.RawMessage(`"stale"`))
		if unsafe {
			if hbErr != nil || cErr != nil || string(get(t, l, "k").Result) != `"stale"` {
				t.Fatalf("fencing off: heartbeat %v, complete %v; want both to go through", hbErr, cErr)
			}
		} else if !errors.Is(hbErr, idempotency.ErrLeaseLost) || !errors.Is(cErr, idempotency.ErrLeaseLost) {
			t.Fatalf("fencing on: heartbeat %v, complete %v; want ErrLeaseLost", hbErr, cErr)
		}
	}
}
