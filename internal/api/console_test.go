package api

import (
	"github.com/idemq/idemq/idempotency"
	"html"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/testenv"
)

// consoleRows writes the ledger rows and events the console tests filter and count, each
// started (and its events recorded) at a known age on the database clock.
func (a *testAPI) consoleRows(t *testing.T) {
	t.Helper()
	ctx := testenv.Context(t, 10*time.Second)
	_, err := a.pool.Exec(ctx, `INSERT INTO processed_jobs
		(idempotency_key, task_type, status, fence, owner, attempts, started_at, locked_until, completed_at, result)
		SELECT k, ty, st, nextval('processed_jobs_fence_seq'), gen_random_uuid(), 1, now() - age::interval,
		       CASE WHEN st = 'in_progress' THEN now() + lease::interval END,
		       CASE WHEN st IN ('completed', 'failed') THEN now() END, '{}'
		FROM (VALUES
			('f:done-new', 'payment:charge', 'completed', '2 minutes', NULL),
			('f:done-old', 'wallet:debit', 'completed', '2 hours', NULL),
			('f:failed', 'payment:charge', 'failed', '30 minutes', NULL),
			('f:attn', 'payment:charge', 'needs_attention', '3 days', NULL),
			('f:live', 'payment:charge', 'in_progress', '1 minute', '1 hour'),
			('f:lapsed', 'payment:charge', 'in_progress', '10 minutes', '-1 minute'),
			('f:dup', 'payment:charge', 'completed', '3 minutes', NULL)
		) AS v(k, ty, st, age, lease)`)
	if err != nil {
		t.Fatal(err)
	}
	_, err = a.pool.Exec(ctx, `INSERT INTO processed_job_events (idempotency_key, kind, at)
		VALUES ('f:dup', 'duplicate', now() - interval '1 minute'), ('f:dup', 'duplicate', now() - interval '2 minutes'),
		       ('f:done-new', 'takeover', now() - interval '2 hours'), ('f:live', 'weird_kind', now() - interval '1 minute')`)
	if err != nil {
		t.Fatal(err)
	}
}

var listedKeyRE = regexp.MustCompile(`<td class="mono key"><a href="[^"]*">([^<]*)</a>`)

// listedKeys are the keys of the rows table of a list page, sorted.
func listedKeys(body string) []string {
	end := strings.Index(body, `id="intents"`)
	if end < 0 {
		end = len(body)
	}
	var keys []string
	for _, m := range listedKeyRE.FindAllStringSubmatch(body[:end], -1) {
		keys = append(keys, html.UnescapeString(m[1]))
	}
	slices.Sort(keys)
	return keys
}

func TestLedgerListFilters(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	a.consoleRows(t)
	for _, tc := range []struct {
		query string
		want  []string
	}{
		{"", []string{"f:attn", "f:done-new", "f:done-old", "f:dup", "f:failed", "f:lapsed", "f:live"}},
		{"status=completed", []string{"f:done-new", "f:done-old", "f:dup"}},
		{"status=in_progress", []string{"f:lapsed", "f:live"}},
		{"status=needs_attention", []string{"f:attn"}},
		{"type=wallet:debit", []string{"f:done-old"}},
		{"type=mail:send", nil},
		{"started_within=5m", []string{"f:done-new", "f:dup", "f:live"}},
		{"started_within=1h", []string{"f:done-new", "f:dup", "f:failed", "f:lapsed", "f:live"}},
		{"older_than=1h", []string{"f:attn", "f:done-old"}},
		{"older_than=24h", []string{"f:attn"}},
		{"attention=1", []string{"f:attn"}},
		{"attention=1&status=needs_attention", []string{"f:attn"}},
		{"duplicates=1", []string{"f:dup"}},
		{"lease=live", []string{"f:live"}},
		{"lease=lapsed", []string{"f:lapsed"}},
		{"attention=0&duplicates=0", []string{"f:attn", "f:done-new", "f:done-old", "f:dup", "f:failed", "f:lapsed", "f:live"}},
		// Combined.
		{"status=completed&type=payment:charge&started_within=5m", []string{"f:done-new", "f:dup"}},
		{"status=completed&type=payment:charge&started_within=5m&duplicates=1", []string{"f:dup"}},
		{"status=in_progress&lease=lapsed&started_within=1h", []string{"f:lapsed"}},
		{"started_within=1h&older_than=15m", []string{"f:failed"}},
		{"duplicates=1&older_than=5m", nil},
		{"status=completed&limit=2", []string{"f:done-new", "f:dup"}}, // the newest two by start
	} {
		page := a.do(t, "GET", "/ledger/?"+tc.query, "").want(t, 200)
		if got := listedKeys(page.body); !slices.Equal(got, tc.want) {
			t.Errorf("?%s: rows %v, want %v", tc.query, got, tc.want)
		}
	}

	// Each bad value is a 400 naming the parameter and what it allows, never a 500.
	for query, want := range map[string]string{
		"status=done":                      `status: "done" is not allowed; allowed: in_progress, completed, failed, needs_attention`,
		"started_within=2h":                `started_within: "2h" is not allowed; allowed: 5m, 15m, 1h, 6h, 24h, 7d, 30d`,
		"older_than=-1h":                   `older_than: "-1h" is not allowed; allowed: 5m, 15m, 1h, 6h, 24h, 7d, 30d`,
		"lease=dead":                       `lease: "dead" is not allowed; allowed: live, lapsed`,
		"attention=yes":                    `attention: "yes" is not allowed; allowed: "" or 0 (off), 1 (on)`,
		"duplicates=2":                     `duplicates: "2" is not allowed`,
		"window=2h":                        `window: "2h" is not allowed; allowed: 5m, 1h, 24h`,
		"limit=abc":                        `limit: "abc" is not allowed; allowed: a whole number from 1`,
		"limit=0":                          `limit: "0" is not allowed`,
		"type=a%20b":                       "type: a task type is at most 128 bytes of printable ASCII without spaces",
		"type=" + strings.Repeat("t", 129): "type: a task type is at most 128 bytes",
		"type=%C3%A9":                      "type: a task type is at most",
		"status=completed&lease=live":      "lease: only in_progress rows have a lease",
		"attention=1&lease=lapsed":         "lease: only in_progress rows have a lease",
		"attention=1&status=failed":        "attention: needs-attention rows only, but status=failed",
	} {
		page := a.do(t, "GET", "/ledger/?"+query, "")
		if page.code != 400 || !strings.Contains(page.body, want) {
			t.Errorf("?%s: %d %q, want 400 with %q", query, page.code, page.body, want)
		}
	}

	// The filters are kept: in the form, in the counts' window links, and in the links
	// that take one filter away.
	page := a.do(t, "GET", "/ledger/?status=completed&type=payment:charge&started_within=5m&duplicates=1&window=24h", "").want(t, 200,
		`<option value="completed" selected>`, `<input name="type" placeholder="task type" size="14" value="payment:charge">`,
		`<option value="5m" selected>started within 5m</option>`, `name="duplicates" value="1" checked>`,
		`<input type="hidden" name="window" value="24h">`)
	links := hrefs(page.body)
	for _, want := range []string{
		"/ledger/?duplicates=1&started_within=5m&status=completed&type=payment%3Acharge&window=5m", // another window
		"/ledger/?duplicates=1&started_within=5m&type=payment%3Acharge&window=24h",                 // without status
		"/ledger/?started_within=5m&status=completed&type=payment%3Acharge&window=24h",             // without duplicates
	} {
		if !slices.Contains(links, want) {
			t.Errorf("no link %q among %q", want, links)
		}
	}
	// A link the page makes lists what the page lists.
	for _, l := range links {
		if strings.HasPrefix(l, "/ledger/?duplicates=1&started_within=5m&status=completed&type=payment%3Acharge") {
			if got := listedKeys(a.do(t, "GET", l, "").want(t, 200).body); !slices.Equal(got, []string{"f:dup"}) {
				t.Errorf("%s lists %v, want [f:dup]", l, got)
			}
		}
	}

	// The lease column: in-progress rows say live or lapsed, every other row shows none.
	page = a.do(t, "GET", "/ledger/", "").want(t, 200, `<span class="lease live">live</span> until `, `<span class="lease lapsed">lapsed</span> at `)
	if n := strings.Count(page.body, `<td class="mono lease-cell">-</td>`); n != 5 {
		t.Errorf("%d rows without a lease, want 5 (every row not in progress)", n)
	}
}

var countRE = regexp.MustCompile(`<span class="n">(\d+)</span><span>([^<]+)</span>`)

// counts reads the counts of a list page: the rows' (id="row-counts") and the events'
// (id="event-counts"), by label.
func counts(t *testing.T, body string) (rows, events map[string]int) {
	t.Helper()
	read := func(id string) map[string]int {
		i := strings.Index(body, `id="`+id+`"`)
		if i < 0 {
			t.Fatalf("no %s on the page:\n%s", id, body)
		}
		part := body[i:]
		part = part[:strings.Index(part, "</div>")]
		out := map[string]int{}
		for _, m := range countRE.FindAllStringSubmatch(part, -1) {
			n, _ := strconv.Atoi(m[1])
			out[m[2]] = n
		}
		return out
	}
	return read("row-counts"), read("event-counts")
}

func TestLedgerListCounts(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	a.consoleRows(t)
	for _, tc := range []struct {
		window        string
		rows          map[string]int
		dup, takeover int
	}{
		{"5m", map[string]int{"completed": 2, "failed": 0, "needs attention": 0, "in progress, live": 1, "in progress, lapsed": 0}, 2, 0},
		{"", map[string]int{"completed": 2, "failed": 1, "needs attention": 0, "in progress, live": 1, "in progress, lapsed": 1}, 2, 0},
		{"24h", map[string]int{"completed": 3, "failed": 1, "needs attention": 0, "in progress, live": 1, "in progress, lapsed": 1}, 2, 1},
	} {
		path := "/ledger/"
		if tc.window != "" {
			path += "?window=" + tc.window
		}
		rows, events := counts(t, a.do(t, "GET", path, "").want(t, 200).body)
		if !mapsEqual(rows, tc.rows) {
			t.Errorf("%s: row counts %v, want %v", path, rows, tc.rows)
		}
		if events["duplicate"] != tc.dup || events["takeover"] != tc.takeover || events["weird_kind"] != 1 || len(events) != len(idempotency.HistoryKinds)+1 {
			t.Errorf("%s: event counts %v, want duplicate %d, takeover %d, weird_kind 1 and every kind", path, events, tc.dup, tc.takeover)
		}
	}
	// Each row count links to the rows it counts.
	page := a.do(t, "GET", "/ledger/?window=24h", "").want(t, 200)
	for label, want := range map[string][]string{
		"in progress, lapsed": {"f:lapsed"},
		"in progress, live":   {"f:live"},
		"completed":           {"f:done-new", "f:done-old", "f:dup"},
	} {
		m := regexp.MustCompile(`<a class="tile [^"]*" href="([^"]*)"><span class="n">\d+</span><span>` + regexp.QuoteMeta(label) + `<`).FindStringSubmatch(page.body)
		if m == nil {
			t.Fatalf("no link for %q", label)
		}
		if got := listedKeys(a.do(t, "GET", html.UnescapeString(m[1]), "").want(t, 200).body); !slices.Equal(got, want) {
			t.Errorf("%q links %s, which lists %v, want %v", label, m[1], got, want)
		}
	}
}

func mapsEqual(a, b map[string]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// TestLedgerListLinksTaskIDs: a listed key links its row page and asynqmon's page of each
// TaskID it was published under (key, key#r<n>), each link reaching that very key or ID
// whatever '/', '%', '#' or ':' they hold (a key may hold '#' from before it was reserved).
func TestLedgerListLinksTaskIDs(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	ctx := testenv.Context(t, 30*time.Second)
	keys := []string{"debit:a/b%41", "debit:x:y?z", "debit:p%2F"}
	for _, key := range keys {
		spec := outbox.Spec{Key: key, Type: "wallet:debit", Payload: []byte(`{}`), Queue: "money/in", MaxRetry: 3,
			Timeout: time.Minute, Retention: time.Hour}
		if _, err := a.client.Enqueue(ctx, spec); err != nil {
			t.Fatal(err)
		}
		a.insertRow(t, key, `{"ok":true}`)
	}
	// A finished row from before '#' was reserved (the constraint is NOT VALID: old rows
	// keep theirs; this private schema drops it to write one).
	if _, err := a.pool.Exec(ctx, `ALTER TABLE processed_jobs DROP CONSTRAINT processed_jobs_key_no_hash_check`); err != nil {
		t.Fatal(err)
	}
	a.insertRow(t, "debit:old#1/%", `{"ok":true}`)
	// Republished twice: its TaskIDs are key, key#r1 and key#r2.
	if _, err := a.pool.Exec(ctx, `UPDATE job_intents SET publish_generation = 2 WHERE idempotency_key = $1`, keys[0]); err != nil {
		t.Fatal(err)
	}

	page := a.do(t, "GET", "/ledger/", "").want(t, 200)
	tasks := map[string]bool{}
	rowsSeen := map[string]bool{}
	for _, href := range hrefs(page.body) {
		u, err := url.Parse(href)
		if err != nil {
			t.Fatalf("link %q: %v", href, err)
		}
		switch {
		case strings.HasPrefix(href, "/monitoring/queues/"):
			if u.RawQuery != "" || u.Fragment != "" {
				t.Fatalf("asynqmon link %q has a query or fragment", href)
			}
			queue, id, ok := strings.Cut(strings.TrimPrefix(u.EscapedPath(), "/monitoring/queues/"), "/tasks/")
			if !ok {
				t.Fatalf("asynqmon link %q", href)
			}
			q, _ := url.PathUnescape(queue)
			i, _ := url.PathUnescape(id)
			if q != "money/in" {
				t.Fatalf("asynqmon link %q: queue %q", href, q)
			}
			tasks[i] = true
		case strings.HasPrefix(href, "/ledger/") && !strings.HasPrefix(href, "/ledger/?") && href != "/ledger/":
			row := a.do(t, "GET", href, "").want(t, 200)
			m := regexp.MustCompile(`<dt>key</dt><dd class="mono"><code>([^<]*)</code>`).FindStringSubmatch(row.body)
			if m == nil {
				t.Fatalf("%s: no row page", href)
			}
			rowsSeen[html.UnescapeString(m[1])] = true
		}
	}
	wantTasks := []string{keys[0], keys[0] + "#r1", keys[0] + "#r2", keys[1], keys[2]}
	for _, id := range wantTasks {
		if !tasks[id] {
			t.Errorf("no asynqmon link reaches task %q (reached %v)", id, tasks)
		}
	}
	if len(tasks) != len(wantTasks) {
		t.Errorf("asynqmon links reach %v, want %v", tasks, wantTasks)
	}
	for _, key := range append(keys, "debit:old#1/%") {
		if !rowsSeen[key] {
			t.Errorf("no row link reaches %q (reached %v)", key, rowsSeen)
		}
	}
}

func TestTaskRefsKeepFirstAndLatest(t *testing.T) {
	refs := taskRefs(outbox.IntentTask{Key: "k", Queue: "q", PublishGeneration: 9})
	var got []string
	for _, r := range refs {
		got = append(got, r.ID+"="+r.Label)
	}
	want := []string{"k=asynqmon", "k#r7=#r7", "k#r8=#r8", "k#r9=#r9"}
	if !slices.Equal(got, want) {
		t.Fatalf("taskRefs = %v, want %v", got, want)
	}
}
