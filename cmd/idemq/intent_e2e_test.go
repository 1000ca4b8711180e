package main

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// A plain asynq producer's task takes a key (under a random TaskID) before the API's
// accepted job with another payload runs: the worker runs the plain task, refuses the
// API's as a mismatch, and the API's intent ends dead with the reason — never done,
// although its key is completed. GET /v1/jobs says so, a replay of the accepted request
// gets its stored 202, the worker counts it, and `idemq ledger show` names it. Both a
// transactional job (a debit) and a leased one (a charge).
func TestAcceptedJobTakenByAnotherPayloadEndsDead(t *testing.T) {
	t.Parallel()
	// One slot: the plain tasks, enqueued first, run first.
	s := startStack(t, 0, nil, []string{"IDEMQ_CONCURRENCY=1"})
	api := startAPI(t, s.workerEnv)

	plainDebit, err := json.Marshal(tasks.Debit{AccountID: "acct-dead", AmountCents: 1, Reference: "dead-ref"})
	if err != nil {
		t.Fatal(err)
	}
	plainCharge, err := json.Marshal(tasks.Charge{OrderID: "dead-order", CustomerID: "cust-dead", AmountCents: 1, Currency: "EUR"})
	if err != nil {
		t.Fatal(err)
	}
	s.enqueue(t, asynq.NewTask(tasks.TypeDebit, plainDebit), asynq.Queue(tasks.Queue))
	s.enqueue(t, asynq.NewTask(tasks.TypeCharge, plainCharge), asynq.Queue(tasks.Queue))

	post := func(path, hk, body string) (int, []byte) {
		t.Helper()
		req, err := http.NewRequest(http.MethodPost, api+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", hk)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}
	jobs := []struct{ key, path, hk, body string }{
		{"debit:dead-ref", "/v1/wallet/debits", "hk-dead-debit", `{"account_id":"acct-dead","amount_cents":2,"reference":"dead-ref"}`},
		{"charge:dead-order", "/v1/charges", "hk-dead-charge", `{"order_id":"dead-order","customer_id":"cust-dead","amount_cents":2,"currency":"EUR"}`},
	}
	first := map[string][]byte{}
	for _, j := range jobs {
		code, body := post(j.path, j.hk, j.body)
		if code != http.StatusAccepted {
			t.Fatalf("%s: POST answered %d %s, want 202 (the ledger does not know the key yet)", j.key, code, body)
		}
		first[j.key] = body
	}

	s.startWorker(t, 0)
	ctx := testenv.Context(t, time.Minute)
	for _, j := range jobs {
		for {
			var state string
			s.pool.QueryRow(ctx, `SELECT state FROM job_intents WHERE idempotency_key = $1`, j.key).Scan(&state)
			info, err := s.insp.GetTaskInfo(tasks.Queue, j.key)
			if state != "published" && state != "pending" && err == nil && info.State == asynq.TaskStateArchived {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("%s: intent %q, task %v %v: the API's task was never archived", j.key, state, info, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
		var state, reason, rowStatus string
		s.pool.QueryRow(ctx, `SELECT i.state, coalesce(i.last_error, ''), p.status FROM job_intents i
			JOIN processed_jobs p USING (idempotency_key) WHERE idempotency_key = $1`, j.key).Scan(&state, &reason, &rowStatus)
		if state != "dead" || !strings.Contains(reason, "mismatch") || rowStatus != "completed" {
			t.Errorf("%s: intent %q (%q), row %q; want the intent dead for a mismatch beside the plain task's completed row",
				j.key, state, reason, rowStatus)
		}

		resp, err := http.Get(api + "/v1/jobs/" + j.key)
		if err != nil {
			t.Fatal(err)
		}
		var got struct {
			Status, Intent, LastError, IntentError string
			Result                                 json.RawMessage
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatalf("GET /v1/jobs/%s: %v: %s", j.key, err, b)
		}
		if got.Status != "dead" || got.Intent != "dead" || !strings.Contains(string(b), "mismatch") || got.Result != nil {
			t.Errorf("GET /v1/jobs/%s = %s; want status and intent dead, the mismatch named, no result (it is another payload's)", j.key, b)
		}

		code, body := post(j.path, j.hk, j.body)
		if code != http.StatusAccepted || !bytes.Equal(body, first[j.key]) {
			t.Errorf("%s: the accepted request's replay answered %d %s, want its stored 202 %s", j.key, code, body, first[j.key])
		}

		out, _, err := idemq(t, []string{"DATABASE_URL=" + s.dsn}, "ledger", "show", j.key)
		if err != nil || !strings.Contains(out, "intent  dead (its task was refused: mismatch") {
			t.Errorf("idemq ledger show %s: %v\n%s\nwant the dead intent and its reason", j.key, err, out)
		}
	}
	if n := s.sum(t, "idemq_intents_dead_total", `reason="mismatch"`); n != 2 {
		t.Errorf("idemq_intents_dead_total{reason=\"mismatch\"} = %v, want 2", n)
	}
}
