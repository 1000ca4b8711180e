package api

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/internal/testledger"
	"github.com/idemq/idemq/tasks"
)

// checkStory checks the history of a key taken through testledger.Story: the takeover
// (the crashed claim's fence and the new one, the delivery's TaskID), the duplicate and
// the mismatch (their TaskIDs) in generation 0, then the rerun in generation 1, each
// naming its worker.
func checkStory(t *testing.T, key string, oldFence, newFence int64, history []HistoryEntry) {
	t.Helper()
	var kinds []string
	for _, e := range history {
		kinds = append(kinds, e.Kind)
		if e.Worker == "" || e.At.IsZero() {
			t.Errorf("event %+v names no worker or time", e)
		}
		switch e.Kind {
		case "takeover":
			if e.Fence != newFence || e.OldFence != oldFence || e.TaskID != key || e.Generation != 0 || e.TaskType != tasks.TypeCharge {
				t.Errorf("takeover %+v; want fence %d, old fence %d, task id %s, generation 0", e, newFence, oldFence, key)
			}
		case "duplicate":
			if e.TaskID != key+"-again" || e.Fence != newFence {
				t.Errorf("duplicate %+v; want task id %s-again, fence %d (the completed claim's)", e, key, newFence)
			}
		case "mismatch":
			if e.TaskID != key+"-other" {
				t.Errorf("mismatch %+v; want task id %s-other", e, key)
			}
		case "rerun":
			if e.Generation != 1 {
				t.Errorf("rerun %+v; want generation 1", e)
			}
		}
	}
	if got := strings.Join(kinds, ","); got != "takeover,duplicate,mismatch,rerun" {
		t.Fatalf("history kinds %s, want takeover,duplicate,mismatch,rerun", got)
	}
}

func TestJobHistory(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	key := "charge:story"
	oldFence, newFence := testledger.Story(t, a.ledger, key, tasks.TypeCharge)

	job := a.do(t, "GET", "/v1/jobs/"+key, "").want(t, 200, `"history":[`)
	var rec Record
	if err := json.Unmarshal([]byte(job.body), &rec); err != nil {
		t.Fatal(err)
	}
	checkStory(t, key, oldFence, newFence, rec.History)
	if !strings.Contains(job.body, fmt.Sprintf(`"old_fence":%d`, oldFence)) {
		t.Fatalf("the JSON names no old_fence %d: %s", oldFence, job.body)
	}

	// The row page shows the same history.
	a.do(t, "GET", "/ledger/"+key, "").want(t, 200, `<table id="history">`,
		`<tr class="event-takeover">`, fmt.Sprintf(`<td class="mono">%d</td><td class="mono">%d</td>`, newFence, oldFence),
		"event-duplicate", key+"-again", "event-mismatch", key+"-other", "event-rerun", rec.History[0].Worker)
	// A key without events shows none.
	a.complete(t, "quiet", `{"charge_id":"ch_q"}`)
	if job := a.do(t, "GET", "/v1/jobs/charge:quiet", "").want(t, 200); strings.Contains(job.body, "history") {
		t.Fatalf("a key with no events shows a history: %s", job.body)
	}
	if page := a.do(t, "GET", "/ledger/charge:quiet", "").want(t, 200); strings.Contains(page.body, `id="history"`) {
		t.Fatal("the row page of a key with no events shows a history table")
	}
}

// TestBrowserShowsHistory loads a row page in headless Chromium and finds the history
// table with its times, workers, TaskIDs and fences in the rendered DOM.
func TestBrowserShowsHistory(t *testing.T) {
	bin := chromium(t)
	t.Parallel()
	a := newTestAPI(t, nil)
	key := "charge:browsed"
	oldFence, newFence := testledger.Story(t, a.ledger, key, tasks.TypeCharge)
	h, err := a.ledger.History(testenv.Context(t, time.Minute), key)
	if err != nil {
		t.Fatal(err)
	}
	dom := browse(t, bin, a.URL+"/ledger/"+key, "--dump-dom")
	i := strings.Index(dom, `id="history"`)
	if i < 0 {
		t.Fatalf("the row page's DOM has no history table:\n%s", tail(dom, 3000))
	}
	table := dom[i:]
	for _, want := range []string{"takeover", "duplicate", "mismatch", "rerun", fmt.Sprint(oldFence), fmt.Sprint(newFence),
		key + "-again", key + "-other", h[0].Worker, stamp(h[0].At)} {
		if !strings.Contains(table, want) {
			t.Fatalf("the history table in the DOM does not contain %q:\n%s", want, tail(table, 3000))
		}
	}
	// The row page with its history, for docs/operations.md (make screenshots).
	dir := os.Getenv("IDEMQ_SCREENSHOT_DIR")
	if dir == "" {
		dir = t.TempDir()
	}
	file, err := filepath.Abs(filepath.Join(dir, "history.png"))
	if err != nil {
		t.Fatal(err)
	}
	browse(t, bin, a.URL+"/ledger/"+key, "--screenshot="+file, "--window-size=1280,900", "--hide-scrollbars")
	if st, err := os.Stat(file); err != nil || st.Size() < 10<<10 {
		t.Fatalf("screenshot %s: %v (size %d), want a PNG of some substance", file, err, sizeOf(st))
	}
}
