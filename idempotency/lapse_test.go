package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// unreachablePool returns a pool whose connections are refused: nothing listens on its
// port.
func unreachablePool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	return testenv.Pool(t, fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?connect_timeout=2", testenv.FreePort(t)))
}

// TestSelfFencedHandlerLeavesLeaseToLapse: a handler that Do cancels because no heartbeat
// reached the database (their pool cannot connect) returns its context's error; the row
// keeps the lease its claim took, so another claimer is refused until the lease ends by
// the database clock, and only then takes the key over.
func TestSelfFencedHandlerLeavesLeaseToLapse(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	const lease, margin = 2 * time.Second, 500 * time.Millisecond
	ev := &events{}
	l, _ := newLedger(t, &idempotency.Config{Lease: lease, SelfFenceMargin: margin, HeartbeatPool: unreachablePool(t), Observe: ev.observe})
	var claimed *idempotency.Record
	var deadline time.Time
	var deadlineOK bool
	_, err := l.Do(ctx, req("lapse"), func(fctx context.Context) (json.RawMessage, error) {
		deadline, deadlineOK = idempotency.LeaseDeadline(fctx)
		claimed = get(t, l, "lapse")
		<-fctx.Done()
		return nil, fctx.Err() // what a handler whose call was cancelled returns
	})
	if !errors.Is(err, idempotency.ErrLeaseLost) || ev.get(idempotency.EventSelfFenced) != 1 {
		t.Fatalf("Do: %v (self_fenced events %d), want ErrLeaseLost after a self-fence", err, ev.get(idempotency.EventSelfFenced))
	}
	if !deadlineOK || !deadline.Before(time.Now()) {
		t.Fatalf("LeaseDeadline in the handler: %v, %t; want the self-fence deadline, now past", deadline, deadlineOK)
	}
	r := get(t, l, "lapse")
	if r.Status != idempotency.StatusInProgress || !r.LockedUntil.Equal(claimed.LockedUntil) || r.Fence != claimed.Fence {
		t.Fatalf("row after the self-fence: %s fence %d until %s; want in progress, fence %d until %s (the claim's lease, not ended)",
			r.Status, r.Fence, r.LockedUntil, claimed.Fence, claimed.LockedUntil)
	}
	// Another claimer is refused while the lease lasts, and takes the key over after it.
	for {
		cr, err := l.Claim(ctx, req("lapse"))
		var busy *idempotency.BusyError
		if errors.As(err, &busy) {
			if busy.Fence != claimed.Fence || !busy.Until.Equal(claimed.LockedUntil) {
				t.Fatalf("busy answer: fence %d until %s; want fence %d until %s", busy.Fence, busy.Until, claimed.Fence, claimed.LockedUntil)
			}
			time.Sleep(100 * time.Millisecond)
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		c := cr.Claim
		if c == nil || c.Fence <= claimed.Fence {
			t.Fatalf("claim after the lease: %+v; want a takeover with a larger fence than %d", cr, claimed.Fence)
		}
		// The claim's lease started at its database time: at or after the old lease's end.
		if startedAt := c.LeaseUntil.Add(-lease); startedAt.Before(claimed.LockedUntil) {
			t.Fatalf("taken over at %s, before the stale lease ended at %s", startedAt, claimed.LockedUntil)
		}
		return
	}
}

// TestLeaseDeadline: a leased handler's context carries its self-fence deadline, which
// each successful heartbeat moves later; outside a leased handler there is none.
func TestLeaseDeadline(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	const lease, margin = 3 * time.Second, 300 * time.Millisecond
	l, _ := newLedger(t, &idempotency.Config{Lease: lease, SelfFenceMargin: margin})
	if _, ok := idempotency.LeaseDeadline(ctx); ok {
		t.Fatal("LeaseDeadline outside a handler: ok")
	}
	_, err := l.Do(ctx, req("deadline"), func(fctx context.Context) (json.RawMessage, error) {
		first, ok := idempotency.LeaseDeadline(fctx)
		if !ok || first.After(time.Now().Add(lease-margin)) {
			return nil, fmt.Errorf("first deadline %v, %t: want by now + lease - margin", first, ok)
		}
		// Wait for a heartbeat (every lease/3) to move it.
		for {
			select {
			case <-fctx.Done():
				return nil, fmt.Errorf("no heartbeat moved the deadline before the self-fence: %w", context.Cause(fctx))
			case <-time.After(50 * time.Millisecond):
			}
			if d, _ := idempotency.LeaseDeadline(fctx); d.After(first) {
				return json.RawMessage(`{}`), nil
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = l.DoTx(ctx, req("tx"), func(ctx context.Context, _ pgx.Tx) (json.RawMessage, error) {
		if _, ok := idempotency.LeaseDeadline(ctx); ok {
			return nil, errors.New("LeaseDeadline in a DoTx handler: ok")
		}
		return json.RawMessage(`{}`), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
