package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// waitGeneration waits until key's ledger row is completed in generation gen, or fails
// after d.
func (s *stack) waitGeneration(t *testing.T, key string, gen int, d time.Duration) {
	t.Helper()
	ctx := testenv.Context(t, d+10*time.Second)
	deadline := time.Now().Add(d)
	var status string
	var got int
	for time.Now().Before(deadline) {
		err := s.pool.QueryRow(ctx, `SELECT status, generation FROM processed_jobs WHERE idempotency_key = $1`, key).Scan(&status, &got)
		if err == nil && status == "completed" && got == gen {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("%s is %s in generation %d after %s, want completed in generation %d", key, status, got, d, gen)
}

func TestLedgerRerunRunsTheJobAgain(t *testing.T) {
	t.Parallel()
	s := startStack(t, 1, nil, nil)
	env := []string{"DATABASE_URL=" + s.dsn, "REDIS_URL=" + s.redisURL}
	ctx := testenv.Context(t, 3*time.Minute)
	const key = "debit:rerun-1"
	enqueue := []string{"enqueue", "debit", "--account-id", "a-1", "--amount-cents", "250", "--reference", "rerun-1"}
	if out, stderr, err := idemq(t, env, enqueue...); err != nil || !strings.Contains(out, "accepted") {
		t.Fatalf("enqueue: %v\n%s%s", err, out, stderr)
	}
	s.waitGeneration(t, key, 0, 60*time.Second)
	intent := func() (state string, gen int) {
		t.Helper()
		if err := s.pool.QueryRow(ctx, `SELECT state, publish_generation FROM job_intents WHERE idempotency_key = $1`, key).Scan(&state, &gen); err != nil {
			t.Fatal(err)
		}
		return state, gen
	}
	// The intent is settled by its completion; wait for it, as an operator would see it.
	for state, _ := intent(); state != "done"; state, _ = intent() {
		time.Sleep(100 * time.Millisecond)
	}

	for gen := 1; gen <= 2; gen++ {
		// The queue is paused while the re-run is checked, so that no worker finishes it
		// meanwhile; the relay still publishes into it.
		if err := s.insp.PauseQueue(tasks.Queue); err != nil {
			t.Fatal(err)
		}
		out, stderr, err := idemq(t, env, "ledger", "rerun", key, "--json")
		if err != nil {
			t.Fatalf("rerun %d: %v\n%s%s", gen, err, out, stderr)
		}
		var got struct {
			Generation  int    `json:"generation"`
			Republished bool   `json:"republished"`
			TaskID      string `json:"task_id"`
		}
		if err := json.Unmarshal([]byte(out), &got); err != nil {
			t.Fatalf("rerun --json: %v: %s", err, out)
		}
		wantID := fmt.Sprintf("%s#r%d", key, gen)
		if got.Generation != gen || !got.Republished || got.TaskID != wantID {
			t.Fatalf("rerun %d: %+v; want generation %d republished as %s", gen, got, gen, wantID)
		}
		// The intent is no longer done: an enqueue of the same job is a duplicate of a
		// job that has yet to run, not of a finished one.
		if state, pg := intent(); state == "done" || state == "dead" || pg != gen {
			t.Fatalf("after rerun %d the intent is %s under publish generation %d; want pending or published under %d", gen, state, pg, gen)
		}
		if out, _, err := idemq(t, env, enqueue...); err != nil || !strings.Contains(out, "duplicate") || strings.Contains(out, "done") {
			t.Fatalf("enqueue after rerun %d: %v\n%s", gen, err, out)
		}
		out, _, err = idemq(t, env, "ledger", "show", key)
		if err != nil || !strings.Contains(out, "(lapsed: the next delivery takes it over)") {
			t.Fatalf("ledger show after rerun %d: %v\n%s", gen, err, out)
		}
		if err := s.insp.UnpauseQueue(tasks.Queue); err != nil {
			t.Fatal(err)
		}
		// A worker runs it again, under the new TaskID, without anyone enqueueing it.
		s.waitGeneration(t, key, gen, 60*time.Second)
		info, err := s.insp.GetTaskInfo(tasks.Queue, wantID)
		if err != nil || info.State != asynq.TaskStateCompleted {
			t.Fatalf("task %s: %+v, %v; want it completed", wantID, info, err)
		}
		for state, _ := intent(); state != "done"; state, _ = intent() {
			time.Sleep(100 * time.Millisecond)
		}
	}

	var entries, fences int
	if err := s.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT fence) FROM wallet_entries WHERE reference = 'rerun-1'`).Scan(&entries, &fences); err != nil {
		t.Fatal(err)
	}
	if entries != 3 || fences != 3 {
		t.Fatalf("wallet entries for rerun-1: %d with %d fences, want 3 runs with 3 fences (the first and two re-runs)", entries, fences)
	}
	out, _, err := idemq(t, env, "ledger", "show", key, "--json")
	if err != nil || !strings.Contains(out, `"status":"completed"`) || !strings.Contains(out, `"generation":2`) {
		t.Fatalf("ledger show after the re-runs: %v\n%s", err, out)
	}
}
