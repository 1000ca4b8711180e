package api

import (
	"context"
	"encoding/json"
	"fmt"
	"html"
	"log/slog"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// complete runs a charge through the ledger as a worker would, with result.
func (a *testAPI) complete(t *testing.T, order, result string) {
	t.Helper()
	spec, err := tasks.ChargeSpec(tasks.Charge{OrderID: order, CustomerID: "c-1", AmountCents: 1999, Currency: "EUR"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = a.ledger.DoTx(testenv.Context(t, 30*time.Second),
		idempotency.Request{Key: spec.Key, TaskType: spec.Type, Fingerprint: idempotency.Fingerprint(spec.Type, spec.Payload)},
		func(context.Context, pgx.Tx) (json.RawMessage, error) { return json.RawMessage(result), nil })
	if err != nil {
		t.Fatal(err)
	}
}

func TestLedgerPage(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	a.publish(t, "o-1")
	a.complete(t, "o-1", `{"charge_id":"ch_1","amount_cents":1999}`)
	a.complete(t, "o-2<script>", `{"charge_id":"ch_2"}`)

	list := a.do(t, "GET", "/ledger/", "").want(t, 200,
		`<a href="/ledger/charge:o-1">charge:o-1</a>`,
		`<span class="status completed">completed</span>`,
		`href="/monitoring/queues/default/tasks/charge:o-1"`,
		`{&#34;charge_id&#34;: &#34;ch_1&#34;, &#34;amount_cents&#34;: 1999}`,
		`charge:o-2&lt;script&gt;`,
	)
	if ct := list.header.Get("Content-Type"); ct != "text/html; charset=utf-8" {
		t.Fatalf("Content-Type %q", ct)
	}
	a.do(t, "GET", "/ledger/?status=completed&limit=1", "").want(t, 200, "newest 1 rows")
	a.do(t, "GET", "/ledger/?status=in_progress", "").want(t, 200, "(no rows)")
	a.do(t, "GET", "/ledger/?status=bogus", "").want(t, 400, `status: "bogus" is not allowed; allowed: in_progress, completed, failed, needs_attention`)

	// The row page, with its asynq task (still pending in Redis) linked.
	a.do(t, "GET", "/ledger/charge:o-1", "").want(t, 200,
		`<code>charge:o-1</code>`, `href="/monitoring/queues/default/tasks/charge:o-1">pending in asynqmon</a>`,
		"&#34;charge_id&#34;: &#34;ch_1&#34;", "attempts")
	// A row without a task in Redis says so.
	a.do(t, "GET", "/ledger/charge:o-2%3Cscript%3E", "").want(t, 200, "not in Redis (done and past its retention")
	a.do(t, "GET", "/ledger/charge:nope", "").want(t, 404, `No ledger row for key <code>charge:nope</code>`)

	// Search: a known key goes to its page, an unknown one says it is missing.
	client := *a.Client()
	client.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	resp, err := client.Get(a.URL + "/ledger/?key=charge:o-1")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ledger/charge:o-1" {
		t.Fatalf("search: %s to %q, want 303 to /ledger/charge:o-1", resp.Status, resp.Header.Get("Location"))
	}
	a.do(t, "GET", "/ledger/?key=charge:zzz", "").want(t, 200, `id="missing"`, "charge:zzz")
	a.do(t, "GET", "/", "").want(t, 200, `id="rows"`)
}

func TestLedgerPageShowsIntents(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	a.publish(t, "waiting") // accepted and published, no worker yet
	a.publish(t, "done")
	a.complete(t, "done", `{"charge_id":"ch_d"}`)

	// The list shows the unfinished outbox; the finished key is not in it.
	page := a.do(t, "GET", "/ledger/", "").want(t, 200, `id="intents"`,
		`<a href="/ledger/charge:waiting">charge:waiting</a>`, `<span class="status intent-published">published</span>`)
	if strings.Contains(page.body[strings.Index(page.body, `id="intents"`):], "charge:done") {
		t.Fatal("a finished job is listed in the outbox")
	}
	// A key no worker claimed yet has a page: accepted, its intent and its task.
	a.do(t, "GET", "/ledger/charge:waiting", "").want(t, 200, `<span class="status accepted">accepted</span>`,
		`id="intent"`, `task id <code>charge:waiting</code>`, `pending in asynqmon</a>`)
	// A completed key shows its intent settled in the same transaction.
	a.do(t, "GET", "/ledger/charge:done", "").want(t, 200, `<span class="status intent-done">done</span>`, "ch_d")
}

// With IDEMQ_TRACE_URL_TEMPLATE set, a key links to the trace of the request that
// accepted it and to the trace of the delivery that did its work (its ledger row's), once
// when they are the same trace; a job enqueued straight to asynq links to its delivery's;
// a key nothing traced links to none.
func TestLedgerRowLinksToItsTrace(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, &Options{TraceURLTemplate: "http://jaeger.example:16686/trace/{trace_id}"})
	ctx := testenv.Context(t, 10*time.Second)
	const (
		requestTrace  = "4bf92f3577b34da6a3ce929d0e0e4736"
		deliveryTrace = "0af7651916cd43dd8448eb211c80319c"
	)
	accept := func(order, traceParent string) string {
		spec, err := tasks.ChargeSpec(tasks.Charge{OrderID: order, CustomerID: "c", AmountCents: 5, Currency: "EUR"})
		if err != nil {
			t.Fatal(err)
		}
		spec.TraceParent = traceParent
		if _, err := a.client.Enqueue(ctx, spec); err != nil {
			t.Fatal(err)
		}
		return spec.Key
	}
	// run completes key in the ledger as a delivery of traceParent's trace would.
	run := func(key, traceParent string) {
		dctx := idempotency.ContextWithTraceParent(ctx, traceParent)
		if _, err := a.ledger.Do(dctx, idempotency.Request{Key: key, TaskType: tasks.TypeCharge}, func(context.Context) (json.RawMessage, error) {
			return json.RawMessage(`{"ok":true}`), nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	link := func(id string) string {
		return `class="trace" href="http://jaeger.example:16686/trace/` + id + `">` + id + `</a>`
	}

	// Accepted in a traced request, not yet run: the request's trace.
	traced := accept("traced", "00-"+requestTrace+"-00f067aa0ba902b7-01")
	a.do(t, "GET", "/ledger/"+traced, "").want(t, 200, `<a id="trace" `+link(requestTrace))
	// Run by a delivery continuing that trace: still one link.
	run(traced, "00-"+requestTrace+"-b7ad6b7169203331-01")
	if page := a.do(t, "GET", "/ledger/"+traced, "").want(t, 200, link(requestTrace)); strings.Count(page.body, `class="trace"`) != 1 {
		t.Fatalf("one trace, linked %d times", strings.Count(page.body, `class="trace"`))
	}
	// Accepted untraced, run by a traced delivery (a re-enqueue from another request, say):
	// the delivery's trace.
	untracedRequest := accept("untraced-request", "")
	run(untracedRequest, "00-"+deliveryTrace+"-b7ad6b7169203331-01")
	a.do(t, "GET", "/ledger/"+untracedRequest, "").want(t, 200, `<a id="trace" `+link(deliveryTrace), "the delivery whose claim holds or did the work")
	// Accepted in one trace, run in another: both.
	both := accept("two-traces", "00-"+requestTrace+"-00f067aa0ba902b7-01")
	run(both, "00-"+deliveryTrace+"-b7ad6b7169203331-01")
	a.do(t, "GET", "/ledger/"+both, "").want(t, 200, link(requestTrace), "the request that accepted it", link(deliveryTrace))
	// Enqueued straight to asynq (no intent), run traced: the row alone links.
	run("charge:direct", "00-"+deliveryTrace+"-b7ad6b7169203331-01")
	a.do(t, "GET", "/ledger/charge:direct", "").want(t, 200, `<a id="trace" `+link(deliveryTrace))
	// A sampled-out delivery records no trace id.
	run("charge:sampled-out", "00-"+deliveryTrace+"-b7ad6b7169203331-00")
	if page := a.do(t, "GET", "/ledger/charge:sampled-out", "").want(t, 200); strings.Contains(page.body, `class="trace"`) {
		t.Fatal("a sampled-out delivery links to a trace")
	}
	// Nothing traced: no link.
	a.publish(t, "untraced")
	if page := a.do(t, "GET", "/ledger/charge:untraced", "").want(t, 200); strings.Contains(page.body, `id="trace"`) {
		t.Fatal("an untraced job links to a trace")
	}
}

func TestPrettyResult(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`{"a":1,"b":[1,2]}`, "{\n  \"a\": 1,\n  \"b\": [\n    1,\n    2\n  ]\n}"},
		{`not json`, "not json"},
		{"\xff\xfe", "non-printable bytes"},
	} {
		if got := prettyResult("payment:charge", []byte(tc.in)); got != tc.want {
			t.Errorf("prettyResult(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// TestLedgerKnowsJobWithoutIntent: a job the ledger completed without an outbox intent
// (published directly, as `idemq enqueue` does) is a duplicate with its result, and
// another body for its key is 422 before anything is recorded.
func TestLedgerKnowsJobWithoutIntent(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	a.complete(t, "o-9", `{"charge_id":"ch_9"}`)
	body := `{"order_id":"o-9","customer_id":"c-1","amount_cents":1999,"currency":"EUR"}`
	a.do(t, "POST", "/v1/charges", body).want(t, 200, `"duplicate":true`, `"status":"completed"`, `"result":{"charge_id":"ch_9"}`)
	a.do(t, "POST", "/v1/charges", `{"order_id":"o-9","customer_id":"c-1","amount_cents":1,"currency":"EUR"}`, "Idempotency-Key", "k").
		wantError(t, 422, `order_id: job "charge:o-9" was already accepted with a different body`)
	var n int
	if err := a.pool.QueryRow(testenv.Context(t, 10*time.Second), `SELECT count(*) FROM api_idempotency_keys`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d header rows (%v) after a refused request, want 0", n, err)
	}
}

// insertRow writes a completed ledger row for key straight into processed_jobs.
func (a *testAPI) insertRow(t *testing.T, key, result string) {
	t.Helper()
	_, err := a.pool.Exec(testenv.Context(t, 10*time.Second), `INSERT INTO processed_jobs
		(idempotency_key, task_type, status, fence, result, attempts, completed_at)
		VALUES ($1, 'payment:charge', 'completed', nextval('processed_jobs_fence_seq'), $2, 1, now())`, key, result)
	if err != nil {
		t.Fatal(err)
	}
}

var hrefRE = regexp.MustCompile(`href="([^"]*)"`)

// hrefs are the page's links, HTML-unescaped.
func hrefs(body string) []string {
	var out []string
	for _, m := range hrefRE.FindAllStringSubmatch(body, -1) {
		out = append(out, html.UnescapeString(m[1]))
	}
	return out
}

// TestLedgerPageLinksReachTheirKey follows every link the ledger pages make to a key
// (its row page, its JSON, its asynqmon task) through the server: each reaches that very
// key, whatever '/', '?', '%' or ".." it holds.
func TestLedgerPageLinksReachTheirKey(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	tricky := []string{"a//b", "q?x", "p%41", "x/../y", "z/", "c&d=e"}
	rows := map[string]bool{}
	for _, id := range tricky {
		rows["debit:"+id] = true
		a.insertRow(t, "debit:"+id, `{"ok":true}`)
		// Accepted through the API, no ledger row: the list's "missing" page links its JSON.
		a.do(t, "POST", "/v1/charges", chargeBody(id, 100)).want(t, 202)
	}

	// followJSON gets href (a /v1/jobs/ link) and reports the key it answers for.
	followJSON := func(href string) string {
		t.Helper()
		ans := a.do(t, "GET", href, "")
		key, _ := ans.json["key"].(string)
		if ans.code != 200 || key == "" {
			t.Fatalf("%s: %d %s, want 200 with a key", href, ans.code, ans.body)
		}
		return key
	}
	// checkTaskLink checks an asynqmon link names key as its task id, unaltered.
	checkTaskLink := func(href, key string) {
		t.Helper()
		u, err := url.Parse(href)
		if err != nil || u.RawQuery != "" || u.Fragment != "" || !strings.HasSuffix(u.Path, "/tasks/"+key) {
			t.Fatalf("asynqmon link %q for %q: path %q query %q fragment %q", href, key, u.Path, u.RawQuery, u.Fragment)
		}
	}

	seen := map[string]bool{}
	followed := map[string]bool{}
	for _, href := range hrefs(a.do(t, "GET", "/ledger/", "").want(t, 200).body) {
		href, _, _ = strings.Cut(href, "#") // the row page's #task: keys have no '#'
		if !strings.HasPrefix(href, "/ledger/") || href == "/ledger/" || strings.HasPrefix(href, "/ledger/?") || followed[href] {
			continue
		}
		followed[href] = true
		page := a.do(t, "GET", href, "").want(t, 200)
		m := regexp.MustCompile(`<dt>key</dt><dd class="mono"><code>([^<]*)</code>`).FindStringSubmatch(page.body)
		if m == nil {
			t.Fatalf("%s: no key on the row page:\n%s", href, page.body)
		}
		key := html.UnescapeString(m[1])
		if seen[key] {
			t.Fatalf("two links reach %q", key)
		}
		seen[key] = true
		for _, h := range hrefs(page.body) {
			switch {
			case strings.HasPrefix(h, "/v1/jobs/"):
				if got := followJSON(h); got != key {
					t.Fatalf("row page of %q links its JSON as %q, which answers for %q", key, h, got)
				}
			case strings.HasPrefix(h, "/monitoring/queues/"):
				checkTaskLink(h, key)
			}
		}
	}
	for key := range rows {
		if !seen[key] {
			t.Errorf("no link on /ledger/ reaches %q (reached: %v)", key, seen)
		}
	}

	// A key with no ledger row yet: the page links the API's answer for it.
	for _, id := range tricky {
		key := "charge:" + id
		page := a.do(t, "GET", "/ledger/?key="+url.QueryEscape(key), "").want(t, 200, `id="missing"`)
		n := 0
		for _, h := range hrefs(page.body) {
			if strings.HasPrefix(h, "/v1/jobs/") {
				n++
				if got := followJSON(h); got != key {
					t.Fatalf("missing page of %q links %q, which answers for %q", key, h, got)
				}
			}
		}
		if n != 1 {
			t.Fatalf("missing page of %q: %d links to /v1/jobs/, want 1", key, n)
		}
	}
}

// TestLedgerRowInvalidKey: a row page for what cannot be a key (a NUL, a byte that is not
// UTF-8, a space, 256 bytes) is a 404 saying why, not a 500 and an error in the log.
func TestLedgerRowInvalidKey(t *testing.T) {
	t.Parallel()
	var logs testenv.LogBuffer
	a := newTestAPI(t, &Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	for _, path := range []string{"/ledger/%00", "/ledger/%ff", "/ledger/a%00b", "/ledger/charge:%C3%A9", "/ledger/a%20b",
		"/ledger/" + strings.Repeat("k", idempotency.MaxKeyBytes+1)} {
		a.do(t, "GET", path, "").want(t, 404, `id="invalid"`, "is not a valid key: ")
	}
	// The search box: an invalid key is reported, not looked up.
	a.do(t, "GET", "/ledger/?key=a%00b", "").want(t, 200, "not a valid key")
	if strings.Contains(logs.String(), "level=ERROR") {
		t.Fatalf("invalid keys logged errors:\n%s", logs.String())
	}
	// A finished row from before '#' was reserved may keep one: its page still opens.
	if err := checkPageKey("charge:old#1"); err != nil {
		t.Fatalf("checkPageKey(charge:old#1) = %v, want nil", err)
	}
}

// TestLedgerPageLimitCapped: ?limit= above maxLedgerPageRows shows maxLedgerPageRows rows,
// and the page says so.
func TestLedgerPageLimitCapped(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	_, err := a.pool.Exec(testenv.Context(t, 10*time.Second), `INSERT INTO processed_jobs
		(idempotency_key, task_type, status, fence, result, attempts, completed_at)
		SELECT 'debit:r-' || i, 'wallet:debit', 'completed', nextval('processed_jobs_fence_seq'), '{}', 1, now()
		FROM generate_series(1, $1::int) i`, maxLedgerPageRows+20)
	if err != nil {
		t.Fatal(err)
	}
	for _, limit := range []string{"1000", "100000", strconv.Itoa(maxLedgerPageRows + 1)} {
		page := a.do(t, "GET", "/ledger/?limit="+limit, "").want(t, 200, fmt.Sprintf("newest %d rows", maxLedgerPageRows))
		if n := strings.Count(page.body, `<td class="mono key">`); n != maxLedgerPageRows {
			t.Fatalf("?limit=%s: %d rows, want %d", limit, n, maxLedgerPageRows)
		}
	}
	page := a.do(t, "GET", "/ledger/?limit=3", "").want(t, 200, "newest 3 rows")
	if n := strings.Count(page.body, `<td class="mono key">`); n != 3 {
		t.Fatalf("?limit=3: %d rows", n)
	}
}

// TestLedgerPageFindsTasksInAnyQueue: a key's asynq task is found in the queue its intent
// recorded, or, published without one, in whichever queue Redis has it.
func TestLedgerPageFindsTasksInAnyQueue(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	ctx := testenv.Context(t, 30*time.Second)
	// Recorded through the outbox, in queue "reports".
	spec := outbox.Spec{Key: "report:r-1", Type: "report:build", Payload: []byte(`{"r":1}`), Queue: "reports",
		MaxRetry: 3, Timeout: time.Minute, Retention: time.Hour}
	if _, err := a.client.Enqueue(ctx, spec); err != nil {
		t.Fatal(err)
	}
	a.insertRow(t, spec.Key, `{"pages":3}`)
	// Published by a plain asynq producer, in queue "critical", no intent.
	opt, err := asynq.ParseRedisURI(a.redisURL)
	if err != nil {
		t.Fatal(err)
	}
	ac := asynq.NewClient(opt)
	defer ac.Close()
	if _, err := ac.EnqueueContext(ctx, asynq.NewTask("mail:send", []byte(`{}`)), asynq.TaskID("mail:m-1"), asynq.Queue("critical")); err != nil {
		t.Fatal(err)
	}
	a.insertRow(t, "mail:m-1", `{"sent":true}`)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := a.s.insp.GetTaskInfo("reports", spec.Key); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("%s never reached Redis: %v", spec.Key, err)
		}
	}

	a.do(t, "GET", "/ledger/report:r-1", "").want(t, 200, `href="/monitoring/queues/reports/tasks/report:r-1">pending in asynqmon</a>`)
	a.do(t, "GET", "/ledger/mail:m-1", "").want(t, 200, `href="/monitoring/queues/critical/tasks/mail:m-1">pending in asynqmon</a>`)
	// The list links the recorded queue; a key without one links its row page, which looks.
	list := a.do(t, "GET", "/ledger/", "").want(t, 200, `href="/monitoring/queues/reports/tasks/report:r-1"`, `href="/ledger/mail:m-1#task"`)
	if strings.Contains(list.body, "/monitoring/queues/default/") {
		t.Fatalf("the list links a task in queue default:\n%s", list.body)
	}
}

func TestJobAndRowPageTellLiveLeaseFromLapsed(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	ctx := testenv.Context(t, 30*time.Second)
	// A live lease: claimed, not finished.
	if _, err := a.ledger.Claim(ctx, idempotency.Request{Key: "charge:live", TaskType: tasks.TypeCharge}); err != nil {
		t.Fatal(err)
	}
	// A lapsed one: a completed key re-run by an operator, which no worker has taken yet.
	a.complete(t, "rerun", `{"charge_id":"ch_1"}`)
	if _, err := a.ledger.Rerun(ctx, "charge:rerun"); err != nil {
		t.Fatal(err)
	}

	a.do(t, "GET", "/v1/jobs/charge:live", "").want(t, 200, `"status":"in_progress"`, `"lease_live":true`)
	a.do(t, "GET", "/v1/jobs/charge:rerun", "").want(t, 200, `"status":"in_progress"`, `"generation":1`, `"lease_live":false`)
	if job := a.do(t, "GET", "/v1/jobs/charge:o-done", ""); strings.Contains(job.body, "lease_live") {
		t.Fatalf("a job that is not in progress names its lease: %s", job.body)
	}
	a.complete(t, "o-done", `{"charge_id":"ch_2"}`)
	if job := a.do(t, "GET", "/v1/jobs/charge:o-done", "").want(t, 200, `"status":"completed"`); strings.Contains(job.body, "lease_live") {
		t.Fatalf("a completed job names its lease: %s", job.body)
	}

	a.do(t, "GET", "/ledger/charge:live", "").want(t, 200, "live: a worker holds the key")
	a.do(t, "GET", "/ledger/charge:rerun", "").want(t, 200, "lapsed at <code>", "no worker holds the key")
	a.do(t, "GET", "/ledger/?status=in_progress", "").want(t, 200, `<span class="lease lapsed">lapsed</span> at `, `<span class="lease live">live</span> until `)
}
