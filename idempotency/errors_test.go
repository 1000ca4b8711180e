package idempotency_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// TestPostgresErrorClasses has the server raise a lock timeout and a statement timeout,
// and checks that each is told for what it is, and not for the other.
func TestPostgresErrorClasses(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, testenv.ServerURL())
	ctx := testenv.Context(t, 10*time.Second)

	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(context.WithoutCancel(ctx))
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_xact_lock(7309475139880105074)`); err != nil {
		t.Fatal(err)
	}
	waiter, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer waiter.Rollback(context.WithoutCancel(ctx))
	_, lockErr := waiter.Exec(ctx, `SET LOCAL lock_timeout = '20ms'; SELECT pg_advisory_xact_lock(7309475139880105074)`)

	slow, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Rollback(context.WithoutCancel(ctx))
	_, cancelErr := slow.Exec(ctx, `SET LOCAL statement_timeout = '20ms'; SELECT pg_sleep(5)`)

	for _, tc := range []struct {
		name                 string
		err                  error
		lockTimeout, cancels bool
	}{
		{"lock timeout", lockErr, true, false},
		{"statement timeout", cancelErr, false, true},
		{"other", errors.New("not the server's"), false, false},
		{"nil", nil, false, false},
	} {
		if got := idempotency.IsLockTimeout(tc.err); got != tc.lockTimeout {
			t.Errorf("%s: IsLockTimeout(%v) = %v, want %v", tc.name, tc.err, got, tc.lockTimeout)
		}
		if got := idempotency.IsQueryCanceled(tc.err); got != tc.cancels {
			t.Errorf("%s: IsQueryCanceled(%v) = %v, want %v", tc.name, tc.err, got, tc.cancels)
		}
	}
}
