package asynqmw_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// An intent recorded with outbox.Client.Enqueue is settled only by a delivery of its own
// task: a plain producer's task (random TaskID) that completes its key first leaves it
// published until the intent's task is answered from the ledger (same payload: done) or
// refused (another payload: dead, mismatch); a payload the worker refuses kills it as
// invalid (so does an amount over tasks.MaxAmountCents queued before the limit existed).
// The Client's status read says so, and the worker counts the dead ones.
func TestIntentSettledOnlyByItsOwnTask(t *testing.T) {
	t.Parallel()
	dead := map[string]int{}
	var deadMu = make(chan struct{}, 1)
	f := newMW(t, 5*time.Second, &asynqmw.Config{ObserveIntentDead: func(taskType, reason string) {
		deadMu <- struct{}{}
		dead[reason]++
		<-deadMu
	}})
	rdb := testenv.Redis(t)
	c := outbox.NewClient(f.pool, rdb, nil)
	client := asynq.NewClientFromRedisClient(rdb)
	ctx := testenv.Context(t, time.Minute)

	plain := func(d tasks.Debit) {
		t.Helper()
		b, err := json.Marshal(d)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := client.Enqueue(asynq.NewTask(tasks.TypeDebit, b), asynq.Queue(tasks.Queue)); err != nil {
			t.Fatal(err)
		}
	}
	accept := func(spec outbox.Spec) {
		t.Helper()
		if _, err := c.Enqueue(ctx, spec); err != nil {
			t.Fatal(err)
		}
	}
	spec := func(d tasks.Debit) outbox.Spec {
		t.Helper()
		s, err := tasks.DebitSpec(d)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	// The plain tasks are queued first; one slot runs them first.
	plain(tasks.Debit{AccountID: "a", AmountCents: 5, Reference: "same"})
	plain(tasks.Debit{AccountID: "a", AmountCents: 1, Reference: "other"})
	accept(spec(tasks.Debit{AccountID: "a", AmountCents: 5, Reference: "same"}))
	accept(spec(tasks.Debit{AccountID: "a", AmountCents: 2, Reference: "other"}))
	accept(outbox.Spec{Key: "debit:bad", Type: tasks.TypeDebit, Payload: []byte(`{"account_id":"a","amount_cents":-5,"reference":"bad"}`),
		Queue: tasks.Queue, MaxRetry: 3, Timeout: time.Minute, Retention: time.Hour})
	// Queued before the amount had a maximum: refused at decode, its intent dead.
	accept(outbox.Spec{Key: "debit:huge", Type: tasks.TypeDebit, Payload: []byte(`{"account_id":"a","amount_cents":9223372036854775807,"reference":"huge"}`),
		Queue: tasks.Queue, MaxRetry: 3, Timeout: time.Minute, Retention: time.Hour})

	cfg := asynq.Config{Concurrency: 1, Queues: map[string]int{tasks.Queue: 1}, LogLevel: asynq.FatalLevel}
	asynqmw.Configure(&cfg)
	srv := asynq.NewServerFromRedisClient(rdb, cfg)
	mux := asynq.NewServeMux()
	mux.Handle(tasks.TypeDebit, f.debit)
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)

	want := map[string]struct{ state, reason string }{
		"debit:same":  {outbox.IntentDone, ""},
		"debit:other": {outbox.IntentDead, "mismatch"},
		"debit:bad":   {outbox.IntentDead, "invalid"},
		"debit:huge":  {outbox.IntentDead, "invalid"},
	}
	for key, w := range want {
		var in *outbox.IntentInfo
		for {
			var err error
			if in, err = c.Intent(ctx, key); err != nil {
				t.Fatal(err)
			}
			if in.State != outbox.IntentPublished || ctx.Err() != nil {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if in.State != w.state || !strings.HasPrefix(in.LastError, w.reason) {
			t.Errorf("%s: intent %s (%q), want %s (%q)", key, in.State, in.LastError, w.state, w.reason)
		}
	}
	if n := f.runs.Load(); n != 2 {
		t.Errorf("%d runs, want 2 (the plain tasks; the intents' own tasks were answered from the ledger or refused)", n)
	}
	deadMu <- struct{}{}
	defer func() { <-deadMu }()
	if dead["mismatch"] != 1 || dead["invalid"] != 2 || len(dead) != 2 {
		t.Errorf("intents counted dead: %v, want one mismatch and two invalid", dead)
	}
}
