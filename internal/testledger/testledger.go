// Package testledger gives a test a Ledger on a fresh migrated schema of its own.
package testledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// New returns a Ledger with cfg on a pool of a fresh migrated schema (testenv.Postgres),
// and the pool; the Ledger is closed when the test ends.
func New(t testing.TB, cfg *idempotency.Config) (*idempotency.Ledger, *pgxpool.Pool) {
	t.Helper()
	pool := testenv.Postgres(t)
	l := idempotency.New(pool, cfg)
	t.Cleanup(l.Close)
	return l, pool
}

// Get returns key's ledger row, failing the test when there is none.
func Get(t testing.TB, l *idempotency.Ledger, key string) *idempotency.Record {
	t.Helper()
	r, err := l.Get(context.Background(), key)
	if err != nil {
		t.Fatalf("Get(%q): %v", key, err)
	}
	return r
}

// JSONEqual reports whether a and b print as the same JSON value, whatever their spacing
// and key order.
func JSONEqual(a, b json.RawMessage) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	return fmt.Sprint(x) == fmt.Sprint(y)
}

// Story takes key, of taskType, through what a key's history records: a claim whose
// worker crashes (its lease lapses) and a delivery that takes it over and completes it, a
// duplicate answered from the ledger, a delivery with another payload refused as a
// mismatch, and an operator's rerun. It waits (within 30 s in all) until l's history of key shows
// all four, and returns the crashed claim's fence and the takeover's.
func Story(t testing.TB, l *idempotency.Ledger, key, taskType string) (oldFence, newFence int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	fp := idempotency.Fingerprint(taskType, []byte(`{"n":1}`))
	req := idempotency.Request{Key: key, TaskType: taskType, Fingerprint: fp, TaskID: key}
	crashed := req
	crashed.Deadline = time.Now().Add(300 * time.Millisecond) // the lease is cut to it
	first, err := l.Claim(ctx, crashed)
	if err != nil || first.Claim == nil {
		t.Fatalf("Story: first claim of %s: %+v, %v", key, first, err)
	}
	time.Sleep(time.Until(first.Claim.LeaseUntil) + 200*time.Millisecond) // the worker is gone
	second, err := l.Claim(ctx, req)
	if err != nil || second.Claim == nil || second.Claim.Attempt != 2 {
		t.Fatalf("Story: takeover of %s: %+v, %v", key, second, err)
	}
	if err := l.Complete(ctx, second.Claim, json.RawMessage(`{"done":true}`)); err != nil {
		t.Fatalf("Story: complete %s: %v", key, err)
	}
	dup := req
	dup.TaskID = key + "-again"
	if res, err := l.Claim(ctx, dup); err != nil || res.Completed == nil || !res.Completed.Cached {
		t.Fatalf("Story: duplicate of %s: %+v, %v; want the cached result", key, res, err)
	}
	other := req
	other.Fingerprint, other.TaskID = idempotency.Fingerprint(taskType, []byte(`{"n":2}`)), key+"-other"
	if _, err := l.Claim(ctx, other); !errors.Is(err, idempotency.ErrMismatch) {
		t.Fatalf("Story: other payload for %s: %v, want ErrMismatch", key, err)
	}
	if _, err := l.Rerun(ctx, key); err != nil {
		t.Fatalf("Story: rerun %s: %v", key, err)
	}
	want := []idempotency.HistoryKind{idempotency.HistoryTakeover, idempotency.HistoryDuplicate, idempotency.HistoryMismatch, idempotency.HistoryRerun}
	for {
		h, err := l.History(ctx, key)
		if err != nil {
			t.Fatalf("Story: history of %s: %v", key, err)
		}
		seen := map[idempotency.HistoryKind]bool{}
		for _, e := range h {
			seen[e.Kind] = true
		}
		all := true
		for _, k := range want {
			all = all && seen[k]
		}
		if all {
			return first.Claim.Fence, second.Claim.Fence
		}
		select {
		case <-ctx.Done():
			t.Fatalf("Story: history of %s is %+v; want %v", key, h, want)
		case <-time.After(100 * time.Millisecond):
		}
	}
}
