package store_test

import (
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/internal/testenv"
)

// A relay's mark of a publish taken under one publish generation leaves an intent an
// operator reopened meanwhile (the next generation) pending: that publish was of the old
// run's TaskID, and the rerun still needs its own.
func TestMarkPublishedMatchesTheTakenGeneration(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ctx := testenv.Context(t, time.Minute)
	for _, key := range []string{"stale", "current"} {
		testenv.Exec(t, pool, `INSERT INTO job_intents (idempotency_key, task_type, payload, payload_sha256, queue, max_retry, timeout_ms, retention_ms,
			state, publish_generation) VALUES ($1, 't', '{}', sha256('{}'), 'default', 3, 1000, 1000, 'pending', 1)`, key)
	}
	err := store.MarkPublished(ctx, pool, []store.Publish{
		{Key: "stale", Taken: 0, Generation: 0},   // taken before the rerun
		{Key: "current", Taken: 1, Generation: 2}, // taken after it, moved past a held TaskID
	})
	if err != nil {
		t.Fatal(err)
	}
	got := testenv.Strings(t, pool, `SELECT idempotency_key || ' ' || state || ' ' || publish_generation FROM job_intents ORDER BY 1`)
	if want := []string{"current published 2", "stale pending 1"}; len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("intents %v, want %v", got, want)
	}
}
