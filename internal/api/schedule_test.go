package api

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency/schedule"
	"github.com/idemq/idemq/internal/testenv"
)

// schedule syncs entries into a's schedule table, pauses "nightly" when it is one of
// them, runs one scheduler round three minutes ahead (so that "@every" entries have
// ticks due) and returns what schedule.List then says.
func (a *testAPI) schedule(t *testing.T, entries ...schedule.Entry) []schedule.Status {
	t.Helper()
	ctx := testenv.Context(t, 30*time.Second)
	s, err := schedule.New(a.pool, a.client, entries, &schedule.Config{
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		// Three minutes on, so that a round enqueues the entries' ticks.
		DatabaseNow: func() time.Time { return time.Now().Add(3 * time.Minute) },
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.Name == "nightly" {
			if err := schedule.Pause(ctx, a.pool, e.Name); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := s.Tick(ctx); err != nil {
		t.Fatal(err)
	}
	list, err := schedule.List(ctx, a.pool, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	return list
}

var testEntries = []schedule.Entry{
	{Name: "nightly", Schedule: "0 3 * * *", TimeZone: "Europe/Berlin", TaskType: "report:nightly", Payload: json.RawMessage(`{"kind":"full"}`)},
	{Name: "every-minute", Schedule: "@every 1m", TaskType: "report:tick", CatchUp: schedule.CatchUpLatest},
}

// TestSchedulePage: /schedule/ lists every entry with its schedule and zone, task type,
// revision, state, last tick, last job (linked to its row page) and next tick; the ledger's
// pages link it; a periodic job's row page links back to its entry; and a key named like
// the route still opens its own row page.
func TestSchedulePage(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	a.do(t, "GET", "/schedule/", "").want(t, 200, `id="schedule"`, "(no entries: start <code>idemq scheduler</code>")

	list := a.schedule(t, testEntries...)
	var job string
	for _, s := range list {
		if s.Name == "every-minute" {
			job = s.LastKey
		}
	}
	if !strings.HasPrefix(job, "cron:every-minute:") {
		t.Fatalf("every-minute's last job is %q after a round, want a cron:every-minute: key (list %+v)", job, list)
	}

	page := a.do(t, "GET", "/schedule/", "").want(t, 200,
		`<tr id="entry-nightly">`, `0 3 * * * <span class="note">(Europe/Berlin)</span>`, "report:nightly",
		`<span class="status paused">paused</span>`,
		`<tr id="entry-every-minute">`, "@every 1m", "report:tick", `<span class="status active">active</span>`,
		`<a href="`+rowLinkOf(job)+`">`+job+`</a> <span class="status intent-`,
	)
	if got := page.header.Get("Content-Security-Policy"); got != ledgerCSP {
		t.Fatalf("schedule page CSP %q, want the ledger page's %q", got, ledgerCSP)
	}
	if got := page.header.Get("Cache-Control"); got != "no-store" {
		t.Fatalf("schedule page Cache-Control %q, want no-store", got)
	}
	// nightly has no tick yet: no last tick and no job, but a next tick.
	nightly := page.body[strings.Index(page.body, `<tr id="entry-nightly">`):]
	nightly = nightly[:strings.Index(nightly, "</tr>")]
	if strings.Count(nightly, ">-<") != 2 {
		t.Fatalf("nightly's row shows a last tick or job, or no next tick:\n%s", nightly)
	}
	if strings.Contains(page.body, "<form") || strings.Contains(page.body, "<button") {
		t.Fatal("the schedule page has a form: it is read-only")
	}

	// The ledger list and the row pages link the schedule page.
	a.do(t, "GET", "/ledger/", "").want(t, 200, `<a href="/schedule/">Schedule</a>`)
	a.do(t, "GET", "/schedule", "").want(t, 200, `id="schedule"`) // redirected

	// The job's row page says whose job it is, and the link reaches the entry's line.
	row := a.do(t, "GET", rowLinkOf(job), "").want(t, 200, `id="schedule-entry"`, `href="/schedule/#entry-every-minute">every-minute</a>`)
	if !slices.Contains(hrefs(row.body), "/schedule/#entry-every-minute") {
		t.Fatalf("row page of %s does not link its entry: %q", job, hrefs(row.body))
	}
	a.insertRow(t, "charge:o-1", `{"ok":true}`)
	if body := a.do(t, "GET", "/ledger/charge:o-1", "").want(t, 200).body; strings.Contains(body, `id="schedule-entry"`) {
		t.Fatal("a charge's row page names a schedule entry")
	}

	// Keys named like the schedule's routes are still keys.
	for _, key := range []string{"schedule", "schedule/", "cron:Bad:x"} {
		a.insertRow(t, key, `{"ok":true}`)
		body := a.do(t, "GET", rowLinkOf(key), "").want(t, 200, `id="row"`, "<code>"+key+"</code>").body
		if strings.Contains(body, `id="schedule-entry"`) {
			t.Fatalf("row page of %q names a schedule entry", key)
		}
	}
}

// rowLinkOf is the ledger page's link to key's row page.
func rowLinkOf(key string) string { return "/ledger/" + url.PathEscape(key) }

func TestScheduleEntryOf(t *testing.T) {
	for key, want := range map[string]string{
		schedule.TickKey("nightly", time.Unix(0, 0)): "nightly",
		schedule.ManualKey("a_b-9", "x:y"):           "a_b-9",
		"cron:nightly":                               "",
		"cron::2026-01-01T00:00:00Z":                 "",
		"cron:Nightly:2026-01-01T00:00:00Z":          "",
		"cron:" + strings.Repeat("a", 65) + ":x":     "",
		"charge:o-1":                                 "",
		"schedule":                                   "",
	} {
		if got := scheduleEntryOf(key); got != want {
			t.Errorf("scheduleEntryOf(%q) = %q, want %q", key, got, want)
		}
	}
}

// TestScheduleJSON: GET /v1/schedule answers {"entries": [...]}, each entry in the shape
// `idemq schedule list --json` prints (NewScheduleEntries), zero times left out.
func TestScheduleJSON(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	ans := a.do(t, "GET", "/v1/schedule", "").want(t, 200)
	if ct := ans.header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Fatalf("Content-Type %q", ct)
	}
	if strings.TrimSpace(ans.body) != `{"entries":[]}` {
		t.Fatalf("empty schedule: %s, want {\"entries\":[]}", ans.body)
	}

	a.schedule(t, testEntries...)
	ans = a.do(t, "GET", "/v1/schedule", "").want(t, 200)
	var got struct {
		Entries []map[string]json.RawMessage `json:"entries"`
	}
	if err := json.Unmarshal([]byte(ans.body), &got); err != nil {
		t.Fatalf("%v: %s", err, ans.body)
	}
	if len(got.Entries) != 2 {
		t.Fatalf("%d entries, want 2: %s", len(got.Entries), ans.body)
	}
	byName := map[string]ScheduleEntry{}
	for _, raw := range got.Entries {
		b, _ := json.Marshal(raw)
		var e ScheduleEntry
		dec := json.NewDecoder(strings.NewReader(string(b)))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&e); err != nil {
			t.Fatalf("an entry not in the CLI's shape: %v: %s", err, b)
		}
		byName[e.Name] = e
		for _, field := range []string{"name", "schedule", "task_type", "revision", "paused", "next_tick"} {
			if _, ok := raw[field]; !ok {
				t.Fatalf("entry %s has no %q: %s", e.Name, field, b)
			}
		}
	}
	n := byName["nightly"]
	if n.Schedule != "0 3 * * *" || n.TimeZone != "Europe/Berlin" || n.TaskType != "report:nightly" || !n.Paused ||
		n.Revision < 1 || n.LastTick != nil || n.LastKey != "" || n.Next == nil || !n.Next.After(time.Now()) || n.Error != "" {
		t.Fatalf("nightly: %+v", n)
	}
	if string(n.Payload) != `{"kind":"full"}` {
		t.Fatalf("nightly's payload %s", n.Payload)
	}
	m := byName["every-minute"]
	if m.Schedule != "@every 1m" || m.Paused || m.CatchUp != string(schedule.CatchUpLatest) || m.LastTick == nil ||
		m.LastKey != schedule.TickKey("every-minute", *m.LastTick) || m.LastState == "" || m.Next == nil {
		t.Fatalf("every-minute: %+v", m)
	}
	if m.Next.Sub(time.Now()) > time.Minute {
		t.Fatalf("every-minute's next tick %v is more than a minute away", m.Next)
	}

	ans = a.do(t, "POST", "/v1/schedule", "{}")
	ans.wantError(t, 405, "not allowed")
	if allow := ans.header.Get("Allow"); allow != "GET, HEAD" {
		t.Fatalf("Allow %q", allow)
	}
}

// TestScheduleAccess: /schedule/ is guarded as the ledger page is, /v1/schedule as the
// API is.
func TestScheduleAccess(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, &Options{ListenAddr: ":8080", DashboardUser: "ops", DashboardPassword: "s3cret", APITokens: []string{testToken}})
	for _, auth := range []string{"", basic("ops", "wrong"), "Bearer " + testToken} {
		ans := a.do(t, "GET", "/schedule/", "", "Authorization", auth)
		ans.wantError(t, 401, "authentication required")
		if !strings.HasPrefix(ans.header.Get("WWW-Authenticate"), "Basic ") {
			t.Fatalf("/schedule/ with %q: 401 without a Basic challenge", auth)
		}
	}
	a.do(t, "GET", "/schedule/", "", "Authorization", basic("ops", "s3cret")).want(t, 200, `id="schedule"`)
	for _, auth := range []string{"", basic("ops", "s3cret"), "Bearer " + otherToken} {
		a.do(t, "GET", "/v1/schedule", "", "Authorization", auth).wantError(t, 401, "IDEMQ_API_TOKEN")
	}
	a.do(t, "GET", "/v1/schedule", "", "Authorization", "Bearer "+testToken).want(t, 200, `"entries":[]`)

	b := newTestAPI(t, &Options{ListenAddr: "0.0.0.0:8080"})
	b.do(t, "GET", "/schedule/", "").wantError(t, 403, "IDEMQ_DASHBOARD_PASSWORD")
	b.do(t, "GET", "/v1/schedule", "").wantError(t, 403, "IDEMQ_API_TOKEN")
}
