package api

import (
	"bytes"
	"context"
	"html"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// chromium finds a headless-capable Chromium. Without one the browser tests skip, except
// under CI=true, where they fail: .ci/run installs Debian's chromium.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	testenv.SkipMissing(t, "chromium", "apt-get install -y chromium")
	return ""
}

// browse runs headless Chromium on url with extra flags and returns its standard output.
// It fails the test on any message the page wrote to the console: errors, refused
// resources and Content-Security-Policy violations are all reported there.
func browse(t *testing.T, bin, url string, extra ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	args := append([]string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
		"--no-first-run", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
		"--user-data-dir=" + t.TempDir(), "--virtual-time-budget=10000", "--enable-logging=stderr", "--v=0"}, extra...)
	args = append(args, url)
	cmd := exec.CommandContext(ctx, bin, args...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		t.Fatalf("chromium %s: %v\n%s", url, err, tail(errOut.String(), 2000))
	}
	if console := consoleLines(errOut.String()); len(console) > 0 {
		t.Fatalf("chromium %s: the page wrote to the console:\n%s", url, strings.Join(console, "\n"))
	}
	return out.String()
}

// consoleLines are the page's console messages in Chromium's log: each is logged as
// [pid:tid:time:LEVEL:CONSOLE:line] "message", source: url (line).
func consoleLines(log string) []string {
	var out []string
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, ":CONSOLE") {
			out = append(out, line)
		}
	}
	return out
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// TestBrowserRendersDashboardAndLedger loads the asynqmon SPA, the ledger page and the
// schedule page in headless Chromium under their Content-Security-Policy and finds the
// queue, the tasks, the keys and the entries in the rendered DOM (data the pages
// fetched), with nothing written to the console (no violation, no error), then takes a
// screenshot of the dashboard and the ledger page (into IDEMQ_SCREENSHOT_DIR when set, as
// `make screenshots` does for docs/).
func TestBrowserRendersDashboardAndLedger(t *testing.T) {
	bin := chromium(t)
	a := newTestAPI(t, nil)
	for _, order := range []string{"order-1001", "order-1002", "order-1003"} {
		a.publish(t, order)
	}
	a.complete(t, "order-1001", `{"charge_id":"ch_3fa9","amount_cents":1999,"currency":"EUR"}`)
	a.complete(t, "order-1002", `{"charge_id":"ch_77b1","amount_cents":1999,"currency":"EUR"}`)
	a.consoleScene(t)

	for path, wants := range map[string][]string{
		"/monitoring/": {"Queues", "default", "Memory usage"},
		"/monitoring/queues/default?status=pending": {"Pending", "order-1003", "payment:charge"},
		"/monitoring/redis":                         {"Redis Info", "redis_version"},
		"/monitoring/servers":                       {"Servers"},
	} {
		dom := browse(t, bin, a.URL+path, "--dump-dom")
		for _, want := range wants {
			if !strings.Contains(dom, want) {
				t.Fatalf("asynqmon's rendered DOM of %s does not contain %q:\n%s", path, want, tail(dom, 3000))
			}
		}
	}
	// The page the ledger links each key to: asynqmon's task page, TaskID = key.
	dom := browse(t, bin, a.URL+taskLink(tasks.Queue, "charge:order-1003"), "--dump-dom")
	if !strings.Contains(dom, "charge:order-1003") || !strings.Contains(dom, "payment:charge") {
		t.Fatalf("asynqmon's task page does not show charge:order-1003:\n%s", tail(dom, 3000))
	}
	dom = browse(t, bin, a.URL+"/ledger/", "--dump-dom")
	for _, want := range []string{"charge:order-1001", "ch_77b1", "/monitoring/queues/default/tasks/charge:order-1002"} {
		if !strings.Contains(dom, want) {
			t.Fatalf("the ledger page's DOM does not contain %q:\n%s", want, tail(dom, 3000))
		}
	}
	dom = browse(t, bin, a.URL+"/ledger/charge:order-1001", "--dump-dom")
	if !strings.Contains(dom, "ch_3fa9") || !strings.Contains(dom, "in asynqmon") {
		t.Fatalf("the ledger row page's DOM does not show charge:order-1001:\n%s", tail(dom, 3000))
	}

	dir := os.Getenv("IDEMQ_SCREENSHOT_DIR")
	if dir == "" {
		dir = t.TempDir()
	}
	// The list page as an operator's console: counts over the last 24 h, one filter set.
	console := "/ledger/?type=payment:charge&window=24h"
	dom = browse(t, bin, a.URL+console, "--dump-dom")
	for _, want := range []string{`id="row-counts"`, "in progress, lapsed", `id="event-counts"`, "duplicate", "type payment:charge ×", "charge:order-1000"} {
		if !strings.Contains(dom, want) {
			t.Fatalf("the ledger console's DOM does not contain %q:\n%s", want, tail(dom, 3000))
		}
	}
	for name, path := range map[string]string{"dashboard.png": "/monitoring/", "ledger.png": console} {
		file, err := filepath.Abs(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		browse(t, bin, a.URL+path, "--screenshot="+file, "--window-size=1280,900", "--hide-scrollbars")
		st, err := os.Stat(file)
		if err != nil || st.Size() < 10<<10 {
			t.Fatalf("screenshot %s: %v (size %d), want a PNG of some substance", file, err, sizeOf(st))
		}
	}

	// The schedule page, under the ledger page's policy (after the screenshots, which
	// would show the periodic job among the ledger's).
	a.schedule(t, testEntries...)
	dom = browse(t, bin, a.URL+"/schedule/", "--dump-dom")
	for _, want := range []string{"every-minute", "cron:every-minute:", "Europe/Berlin", "paused"} {
		if !strings.Contains(dom, want) {
			t.Fatalf("the schedule page's DOM does not contain %q:\n%s", want, tail(dom, 3000))
		}
	}
}

func sizeOf(st os.FileInfo) int64 {
	if st == nil {
		return 0
	}
	return st.Size()
}

// consoleScene adds what an operator's console shows besides finished jobs: a job
// running under a live lease, one whose lease lapsed, a failed one, and events of the
// last hours (duplicates answered from the ledger, a takeover, a busy key).
func (a *testAPI) consoleScene(t *testing.T) {
	t.Helper()
	_, err := a.pool.Exec(testenv.Context(t, 10*time.Second), `
	INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, attempts, started_at, locked_until, completed_at, last_error)
	VALUES ('charge:order-1004', 'payment:charge', 'in_progress', nextval('processed_jobs_fence_seq'), gen_random_uuid(), 1,
	        now() - interval '20 seconds', now() + interval '30 minutes', NULL, NULL),
	       ('charge:order-1000', 'payment:charge', 'in_progress', nextval('processed_jobs_fence_seq'), gen_random_uuid(), 2,
	        now() - interval '9 minutes', now() - interval '4 minutes', NULL, 'worker lost its lease'),
	       ('charge:order-0999', 'payment:charge', 'failed', nextval('processed_jobs_fence_seq'), gen_random_uuid(), 1,
	        now() - interval '3 hours', NULL, now() - interval '3 hours', 'card_declined: permanent');
	INSERT INTO processed_job_events (idempotency_key, kind, at, task_type)
	VALUES ('charge:order-1001', 'duplicate', now() - interval '5 minutes', 'payment:charge'),
	       ('charge:order-1001', 'duplicate', now() - interval '2 minutes', 'payment:charge'),
	       ('charge:order-1000', 'takeover', now() - interval '3 minutes', 'payment:charge'),
	       ('charge:order-1004', 'busy', now() - interval '1 minute', 'payment:charge')`)
	if err != nil {
		t.Fatal(err)
	}
}

// TestBrowserShowsWholeTaskIDs: asynqmon's task list shows a task ID whole
// (charge:order-123, not charge:order), and a task's page links to the ledger row of its
// key, a republish's #r<n> taken off.
func TestBrowserShowsWholeTaskIDs(t *testing.T) {
	bin := chromium(t)
	a := newTestAPI(t, nil)
	ctx := testenv.Context(t, 30*time.Second)
	opt, err := asynq.ParseRedisURI(a.redisURL)
	if err != nil {
		t.Fatal(err)
	}
	ac := asynq.NewClient(opt)
	defer ac.Close()
	for _, id := range []string{"charge:order-123", "charge:order-123#r2"} {
		if _, err := ac.EnqueueContext(ctx, asynq.NewTask("payment:charge", []byte(`{}`)), asynq.TaskID(id), asynq.Queue(tasks.Queue)); err != nil {
			t.Fatal(err)
		}
	}
	a.insertRow(t, "charge:order-123", `{"charge_id":"ch_123"}`)

	dom := browse(t, bin, a.URL+"/monitoring/queues/default?status=pending", "--dump-dom")
	if !strings.Contains(dom, ">charge:order-123<") || !strings.Contains(dom, ">charge:order-123#r2<") || strings.Contains(dom, ">charge:order<") {
		t.Fatalf("asynqmon's task list does not show charge:order-123 whole:\n%s", tail(dom, 4000))
	}

	dom = browse(t, bin, a.URL+taskLink(tasks.Queue, "charge:order-123#r2"), "--dump-dom")
	m := regexp.MustCompile(`<a id="idemq-ledger-link"[^>]* href="([^"]*)"[^>]*>([^<]*)</a>`).FindStringSubmatch(dom)
	if m == nil || !strings.Contains(dom, "charge:order-123#r2") {
		t.Fatalf("asynqmon's task page has no ledger link or does not show the task:\n%s", tail(dom, 4000))
	}
	href := html.UnescapeString(m[1])
	if href != "/ledger/charge%3Aorder-123" || m[2] != "Ledger row of charge:order-123" {
		t.Fatalf("ledger link %q %q, want /ledger/charge%%3Aorder-123", href, m[2])
	}
	a.do(t, "GET", href, "").want(t, 200, "<code>charge:order-123</code>", "ch_123")
	// Elsewhere in the dashboard there is no such link.
	if dom := browse(t, bin, a.URL+"/monitoring/queues/default", "--dump-dom"); strings.Contains(dom, `<a id="idemq-ledger-link"`) {
		t.Fatal("the queue page shows a ledger link")
	}
}
