package api

import (
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// checkoutWithSteps runs key as a leased job that records the steps charge (a Step) and
// record (a StepTx), as the worker's order:checkout does, and returns its result.
func (a *testAPI) checkoutWithSteps(t *testing.T, key string) idempotency.Result {
	t.Helper()
	ctx := testenv.Context(t, 30*time.Second)
	payload := []byte(`{"key":"` + key + `"}`)
	res, err := a.ledger.Do(ctx, idempotency.Request{Key: key, TaskType: tasks.TypeCheckout, Fingerprint: idempotency.Fingerprint(tasks.TypeCheckout, payload)},
		func(ctx context.Context) (json.RawMessage, error) {
			if _, err := idempotency.Step(ctx, "charge", func(context.Context, string) (map[string]string, error) {
				return map[string]string{"charge_id": "ch_steps"}, nil
			}); err != nil {
				return nil, err
			}
			if _, err := idempotency.StepTx(ctx, "record", func(context.Context, pgx.Tx) (int, error) { return 7, nil }); err != nil {
				return nil, err
			}
			return json.RawMessage(`{"order_id":"o-steps"}`), nil
		})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func TestJobShowsItsSteps(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	res := a.checkoutWithSteps(t, "checkout:o-steps")
	job := a.do(t, "GET", "/v1/jobs/checkout:o-steps", "").want(t, 200, `"status":"completed"`)
	var out struct {
		Steps []Step `json:"steps"`
	}
	if err := json.Unmarshal([]byte(job.body), &out); err != nil {
		t.Fatal(err)
	}
	if len(out.Steps) != 2 || out.Steps[0].Name != "charge" || string(out.Steps[0].Result) != `{"charge_id":"ch_steps"}` ||
		out.Steps[1].Name != "record" || string(out.Steps[1].Result) != "7" ||
		out.Steps[0].Fence != res.Fence || out.Steps[1].Fence != res.Fence || out.Steps[0].CreatedAt.IsZero() {
		t.Errorf("steps %+v, want charge then record under fence %d\n%s", out.Steps, res.Fence, job.body)
	}

	a.complete(t, "o-nosteps", `{"charge_id":"ch_1"}`)
	if job := a.do(t, "GET", "/v1/jobs/charge:o-nosteps", "").want(t, 200, `"status":"completed"`); strings.Contains(job.body, `"steps"`) {
		t.Errorf("a job without steps names steps: %s", job.body)
	}
}

func TestRowPageListsItsSteps(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	res := a.checkoutWithSteps(t, "checkout:o-page")
	page := a.do(t, "GET", "/ledger/checkout:o-page", "").want(t, 200, `<table id="steps">`,
		`<td class="mono">charge</td><td class="mono">`+strconv.FormatInt(res.Fence, 10)+`</td>`, `<td class="mono">record</td>`, "ch_steps")
	if strings.Index(page.body, ">charge<") > strings.Index(page.body, ">record<") {
		t.Errorf("steps out of order:\n%s", page.body)
	}
	a.complete(t, "o-page-nosteps", `{"charge_id":"ch_1"}`)
	if page := a.do(t, "GET", "/ledger/charge:o-page-nosteps", "").want(t, 200, "ch_1"); strings.Contains(page.body, `id="steps"`) {
		t.Errorf("a row without steps lists steps:\n%s", page.body)
	}
}
