package api

import (
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// A leased run's completion leaves locked_until set, but a row that is not in progress
// holds no lease: the row page and the list say "-", /v1/jobs says null.
func TestFinishedRowShowsNoLease(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	ctx := testenv.Context(t, 30*time.Second)
	req := idempotency.Request{Key: "charge:leased-done", TaskType: tasks.TypeCharge}
	if _, err := a.ledger.Do(ctx, req, func(context.Context) (json.RawMessage, error) {
		return json.RawMessage(`{"charge_id":"ch_9"}`), nil
	}); err != nil {
		t.Fatal(err)
	}
	if n := testenv.Count(t, a.pool, "SELECT count(*) FROM processed_jobs WHERE idempotency_key = 'charge:leased-done' AND status = 'completed' AND locked_until IS NOT NULL"); n != 1 {
		t.Fatalf("a leased completion left locked_until NULL: this test no longer tests anything")
	}

	job := a.do(t, "GET", "/v1/jobs/charge:leased-done", "").want(t, 200, `"status":"completed"`)
	if !strings.Contains(job.body, `"locked_until":null`) {
		t.Errorf("/v1/jobs of a completed row: want \"locked_until\":null:\n%s", job.body)
	}
	row := a.do(t, "GET", "/ledger/charge:leased-done", "").want(t, 200)
	if m := regexp.MustCompile(`<dt>lease[^<]*</dt><dd[^>]*>(.*?)</dd>`).FindStringSubmatch(row.body); m == nil || m[1] != "-" {
		t.Errorf("the row page's lease of a completed row: %q, want \"-\"", m)
	}

	// A live lease still shows its end.
	if _, err := a.ledger.Claim(ctx, idempotency.Request{Key: "charge:live", TaskType: tasks.TypeCharge}); err != nil {
		t.Fatal(err)
	}
	a.do(t, "GET", "/v1/jobs/charge:live", "").want(t, 200, `"lease_live":true`, `"locked_until":"`)
}

// The ledger list keeps each date on one line, however narrow its columns get.
func TestLedgerListDatesDoNotWrap(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	a.insertRow(t, "charge:o-wide", `{"charge_id":"`+strings.Repeat("x", 70)+`"}`)
	body := a.do(t, "GET", "/ledger/", "").want(t, 200).body
	nowrap := map[string]bool{}
	for _, m := range regexp.MustCompile(`([a-z.,\s-]+)\{([^}]*)\}`).FindAllStringSubmatch(body, -1) {
		if strings.Contains(m[2], "white-space:nowrap") {
			for _, sel := range strings.Split(m[1], ",") {
				nowrap[strings.TrimSpace(sel)] = true
			}
		}
	}
	stampRE := regexp.MustCompile(`^\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ$`)
	cells := regexp.MustCompile(`<td class="([^"]*)">([^<]*)</td>`).FindAllStringSubmatch(body, -1)
	dates := 0
	for _, c := range cells {
		if !stampRE.MatchString(c[2]) {
			continue
		}
		dates++
		held := false
		for _, class := range strings.Fields(c[1]) {
			held = held || nowrap["td."+class] || nowrap["."+class]
		}
		if !held {
			t.Errorf("date cell <td class=%q>%s</td> may wrap: no white-space:nowrap rule for its classes", c[1], c[2])
		}
	}
	if dates < 2 {
		t.Fatalf("found %d date cells in the list, want the row's started and updated:\n%s", dates, body)
	}
}
