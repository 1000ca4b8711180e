package main

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// A currency is case-insensitive: "usd" through the API and "USD" or "Usd" from a plain
// asynq producer (hand-written JSON, no idemq headers, its own TaskID) are one job with
// one fingerprint, so one charge, one completed row and no mismatch.
func TestEndToEndCurrencyCaseIsOneJob(t *testing.T) {
	t.Parallel()
	// The provider does not honour keys: a second charge would show.
	s := startStack(t, 1, []string{"IDEMQ_FAKEPAY_HONOR_KEYS=false"}, nil)
	api := startAPI(t, s.workerEnv)
	post := func(cur string) (int, string) {
		t.Helper()
		resp, err := http.Post(api+"/v1/charges", "application/json",
			strings.NewReader(`{"order_id":"cur-1","customer_id":"c-1","amount_cents":1999,"currency":"`+cur+`"}`))
		if err != nil {
			t.Fatalf("POST: %v", err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}

	if code, body := post("usd"); code != http.StatusAccepted {
		t.Fatalf("POST usd: %d %s, want 202", code, body)
	}
	s.waitCompleted(t, 1, 60*time.Second)
	for _, cur := range []string{"USD", "Usd"} {
		s.enqueue(t, asynq.NewTask(tasks.TypeCharge,
			[]byte(`{"order_id":"cur-1","customer_id":"c-1","amount_cents":1999,"currency":"`+cur+`"}`)))
	}

	ctx := testenv.Context(t, 90*time.Second)
	var q *asynq.QueueInfo
	for {
		var err error
		if q, err = s.insp.GetQueueInfo(tasks.Queue); err != nil {
			t.Fatal(err)
		}
		if q.Pending+q.Active+q.Scheduled+q.Retry == 0 && q.ProcessedTotal >= 3 {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("queue did not drain: %+v", q)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if q.Archived != 0 || q.FailedTotal != 0 {
		archived, _ := s.insp.ListArchivedTasks(tasks.Queue)
		for _, info := range archived {
			t.Logf("archived %s: %s", info.ID, info.LastErr)
		}
		t.Fatalf("asynq queue: archived %d, failed %d; want 0 (no mismatch between spellings)", q.Archived, q.FailedTotal)
	}

	var charges int
	var currencies string
	if err := s.pool.QueryRow(ctx, `SELECT count(*), coalesce(string_agg(currency, ','), '') FROM fakepay_charges WHERE order_id = 'cur-1'`).Scan(&charges, &currencies); err != nil {
		t.Fatal(err)
	}
	if charges != 1 || currencies != "USD" {
		t.Fatalf("fakepay charges for cur-1: %d in %q, want 1 in USD", charges, currencies)
	}
	var rows int
	var status string
	if err := s.pool.QueryRow(ctx, `SELECT count(*), coalesce(min(status), '') FROM processed_jobs`).Scan(&rows, &status); err != nil {
		t.Fatal(err)
	}
	if rows != 1 || status != "completed" {
		t.Fatalf("ledger: %d rows (status %q), want one completed row", rows, status)
	}
	if hits := s.sum(t, "idemq_ledger_events_total", `event="cache_hit"`); hits != 2 {
		t.Errorf("cached-result answers = %v, want 2 (the plain producer's two tasks)", hits)
	}
	if code, body := post("USD"); code != http.StatusOK || !strings.Contains(body, `"status":"completed"`) {
		t.Fatalf("POST USD: %d %s, want 200 with the completed job", code, body)
	}
}
