package migrations_test

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestKeysWithoutHashRefusesUnfinishedRows applies the migrations up to the one before the
// '#' constraints, leaves an in-progress ledger row and a published intent with a '#' in
// their keys, and checks that the migration refuses, naming both counts; once the rows
// are finished it applies, and a new key with a '#' is refused by the database.
func TestKeysWithoutHashRefusesUnfinishedRows(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pool, p := migratedTo(ctx, t, 40)
	if _, err := pool.Exec(ctx, `
		INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, locked_until, attempts, completed_at)
		VALUES ('debit:victim#r1', 'wallet:debit', 'in_progress', 1, gen_random_uuid(), now() + interval '1 minute', 1, NULL),
		       ('debit:old#done', 'wallet:debit', 'completed', 2, NULL, NULL, 1, now())`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `
		INSERT INTO job_intents (idempotency_key, task_type, payload, payload_sha256, queue, max_retry, timeout_ms, retention_ms, state, published_at)
		VALUES ('debit:a#b', 'wallet:debit', '{}', sha256(''), 'default', 1, 1000, 1000, 'published', now())`); err != nil {
		t.Fatal(err)
	}

	_, err := p.Up(ctx)
	if err == nil {
		t.Fatal("the migration applied with unfinished rows whose keys hold '#'")
	}
	if msg := err.Error(); !strings.Contains(msg, "1 unfinished processed_jobs rows and 1 unfinished job_intents rows") {
		t.Fatalf("the refusal does not name the counts: %v", msg)
	}

	if _, err := pool.Exec(ctx, `UPDATE processed_jobs SET status = 'completed', completed_at = now(), owner = NULL, locked_until = NULL WHERE idempotency_key = 'debit:victim#r1'`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE job_intents SET state = 'done', finished_at = now()`); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatalf("the migration refused although every row with '#' is finished: %v", err)
	}
	_, err = pool.Exec(ctx, `
		INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, locked_until, attempts)
		VALUES ('debit:new#r2', 'wallet:debit', 'in_progress', 3, gen_random_uuid(), now(), 1)`)
	if err == nil || !strings.Contains(err.Error(), "processed_jobs_key_no_hash_check") {
		t.Fatalf("a key with '#' was not refused by processed_jobs: %v", err)
	}
	_, err = pool.Exec(ctx, `
		INSERT INTO job_intents (idempotency_key, task_type, payload, payload_sha256, queue, max_retry, timeout_ms, retention_ms)
		VALUES ('debit:new#r2', 'wallet:debit', '{}', sha256(''), 'default', 1, 1000, 1000)`)
	if err == nil || !strings.Contains(err.Error(), "job_intents_key_no_hash_check") {
		t.Fatalf("a key with '#' was not refused by job_intents: %v", err)
	}
}
