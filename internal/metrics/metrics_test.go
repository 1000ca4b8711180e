package metrics

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/internal/testenv"
)

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestReadyzHidesDetail: /readyz is unauthenticated, so a failing dependency is named but
// its error (which carries the Postgres user, database and address) goes to the log only.
func TestReadyzHidesDetail(t *testing.T) {
	t.Parallel()
	good := testenv.Postgres(t)
	rdb := testenv.Redis(t)

	// A real Postgres refusing a role that does not exist, and a Redis port nobody serves.
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.User = "idemq_no_such_role"
	badPG, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(badPG.Close)
	deadAddr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	badRedis := redis.NewClient(&redis.Options{Addr: deadAddr, MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { badRedis.Close() })

	pgOK := func(ctx context.Context) error { return good.Ping(ctx) }
	redisOK := func(ctx context.Context) error { return rdb.Ping(ctx).Err() }
	for _, tc := range []struct {
		name      string
		checks    map[string]Check
		code      int
		body      string
		logged    []string
		notInBody []string
	}{
		{"ready", map[string]Check{"postgres": pgOK, "redis": redisOK}, 200, "ready\n", nil, nil},
		{"postgres down", map[string]Check{"postgres": func(ctx context.Context) error { return badPG.Ping(ctx) }, "redis": redisOK},
			503, "postgres: unavailable\n", []string{"idemq_no_such_role"}, []string{"idemq_no_such_role", "user=", "database=", cfg.ConnConfig.Host}},
		{"redis down", map[string]Check{"postgres": pgOK, "redis": func(ctx context.Context) error { return badRedis.Ping(ctx).Err() }},
			503, "redis: unavailable\n", []string{deadAddr}, []string{deadAddr, "dial", "refused"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs testenv.LogBuffer
			srv := httptest.NewServer(New().Handler(tc.checks, slog.New(slog.NewTextHandler(&logs, nil))))
			defer srv.Close()
			code, body := get(t, srv.URL+"/readyz")
			if code != tc.code || body != tc.body {
				t.Fatalf("/readyz: %d %q, want %d %q", code, body, tc.code, tc.body)
			}
			for _, s := range tc.notInBody {
				if strings.Contains(body, s) {
					t.Fatalf("/readyz body %q reveals %q", body, s)
				}
			}
			for _, s := range tc.logged {
				if !strings.Contains(logs.String(), s) {
					t.Fatalf("log %q does not carry the detail %q", logs.String(), s)
				}
			}
		})
	}
}

// A delivery observed inside a sampled span leaves its trace id as the exemplar of the
// duration histogram, served in the OpenMetrics format to a scraper that asks for it; the
// classic text format is unchanged.
func TestHandlerDurationExemplars(t *testing.T) {
	t.Parallel()
	m := New()
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{0x4b, 0xf9}, SpanID: trace.SpanID{1}, TraceFlags: trace.FlagsSampled})
	m.ObserveHandler(trace.ContextWithSpanContext(context.Background(), sc), "payment:charge", "completed", 30*time.Millisecond)
	m.ObserveHandler(context.Background(), "payment:charge", "completed", 40*time.Millisecond)
	srv := httptest.NewServer(m.Handler(nil, slog.New(slog.DiscardHandler)))
	defer srv.Close()
	scrape := func(accept string) string {
		t.Helper()
		req, _ := http.NewRequest("GET", srv.URL+"/metrics", nil)
		req.Header.Set("Accept", accept)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b)
	}
	want := `trace_id="` + sc.TraceID().String() + `"`
	if body := scrape("application/openmetrics-text; version=1.0.0"); !strings.Contains(body, want) {
		t.Fatalf("OpenMetrics scrape has no exemplar %s:\n%s", want, grep(body, "idemq_handler_duration"))
	}
	if body := scrape("text/plain"); strings.Contains(body, "trace_id") || !strings.Contains(body, `idemq_handler_duration_seconds_count{outcome="completed",task_type="payment:charge"} 2`) {
		t.Fatalf("text scrape:\n%s", grep(body, "idemq_handler_duration"))
	}
}

// grep returns the lines of s that contain sub.
func grep(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// The Observe methods count into the vectors' own series, from many goroutines at once
// and for label values seen for the first time concurrently.
func TestObserveMethodsCountIntoTheVectors(t *testing.T) {
	t.Parallel()
	m := New()
	const goroutines, rounds = 8, 200
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range rounds {
				taskType := fmt.Sprintf("type-%d", (g+i)%5)
				m.ObserveLedger("completed", taskType)
				m.ObserveLock("obtained", taskType)
				m.ObserveOutbox("published", taskType)
				m.ObserveBatch("tx", 3)
				m.ObserveHandler(context.Background(), taskType, "completed", time.Millisecond)
				m.ObserveStep(taskType, "charge", "ran")
			}
		}()
	}
	wg.Wait()
	body := scrapeText(t, m)
	for _, line := range []string{
		`idemq_ledger_events_total{event="completed",task_type="type-0"} 320`,
		`idemq_ledger_events_total{event="completed",task_type="type-4"} 320`,
		`idemq_lock_events_total{event="obtained",task_type="type-2"} 320`,
		`idemq_outbox_events_total{event="published",task_type="type-3"} 320`,
		`idemq_ledger_commit_requests_count{kind="tx"} 1600`,
		`idemq_handler_duration_seconds_count{outcome="completed",task_type="type-1"} 320`,
		`idemq_steps_total{outcome="ran",step="charge",task_type="type-2"} 320`,
	} {
		if !strings.Contains(body, line+"\n") {
			t.Fatalf("scrape lacks %q:\n%s", line, grep(body, "idemq_"))
		}
	}
	if n := strings.Count(body, "\nidemq_ledger_events_total{"); n != 5 {
		t.Fatalf("ledger event series = %d, want 5 (one per task type):\n%s", n, grep(body, "idemq_ledger_events"))
	}
}

// scrapeText returns m's /metrics in the text format.
func scrapeText(t *testing.T, m *Metrics) string {
	t.Helper()
	srv := httptest.NewServer(m.Handler(nil, slog.New(slog.DiscardHandler)))
	defer srv.Close()
	_, body := get(t, srv.URL+"/metrics")
	return body
}

// Every idemq metric passes Prometheus's own lint (promtool check metrics runs the same
// rules) and is listed in docs/operations.md, the operators' table of metrics.
func TestMetricsLintAndAreDocumented(t *testing.T) {
	t.Parallel()
	m := New()
	// A vector shows in a scrape once it has a series: give each one.
	m.ObserveLedger("completed", "t")
	m.ObserveLock("obtained", "t")
	m.ObserveOutbox("published", "t")
	m.ObserveBatch("tx", 1)
	m.ObserveHandler(context.Background(), "t", "completed", time.Millisecond)
	m.ObserveStep("t", "charge", "ran")
	m.APIRequests.WithLabelValues("POST /v1/charges", "202").Inc()
	m.IntentsDead.WithLabelValues("mismatch", "t").Inc()
	m.AsynqRecovered.WithLabelValues("t").Inc()
	m.OverBudget.WithLabelValues("busy", "t").Inc()
	m.ObserveHistory("written", 1)
	m.ObservePurge("processed_jobs", 3, time.Millisecond)
	m.ObservePurgeBacklog(0, time.Minute)

	families, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	problems, err := promlint.NewWithMetricFamilies(families).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		if strings.HasPrefix(p.Metric, "idemq_") {
			t.Errorf("promlint: %s: %s", p.Metric, p.Text)
		}
	}
	doc, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, f := range families {
		if name := f.GetName(); strings.HasPrefix(name, "idemq_") {
			n++
			if !strings.Contains(string(doc), "`"+name+"`") {
				t.Errorf("docs/operations.md does not list %s", name)
			}
		}
	}
	if want := 15; n != want {
		t.Errorf("found %d idemq metrics, want %d: a vector without a series is missing from this test", n, want)
	}
}

// Init makes the series alerts watch exist at zero before their first event.
func TestInitCreatesAlertedSeriesAtZero(t *testing.T) {
	t.Parallel()
	m := New()
	m.Init("t")
	families, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	series := map[string]bool{}
	for _, f := range families {
		if !strings.HasPrefix(f.GetName(), "idemq_") {
			continue
		}
		for _, s := range f.GetMetric() {
			if c := s.GetCounter(); c != nil && c.GetValue() != 0 {
				t.Errorf("%s %v = %v after Init, want 0", f.GetName(), s.GetLabel(), c.GetValue())
			}
			var labels []string
			for _, l := range s.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			series[f.GetName()+"{"+strings.Join(labels, ",")+"}"] = true
		}
	}
	for _, want := range []string{
		"idemq_ledger_events_total{event=mismatch,task_type=t}",
		"idemq_ledger_events_total{event=commit_unknown,task_type=t}",
		"idemq_intents_dead_total{reason=archived,task_type=t}",
		"idemq_outbox_events_total{event=republished,task_type=t}",
		"idemq_busy_budget_exceeded_total{reason=busy,task_type=t}",
		"idemq_asynq_recovered_total{task_type=t}",
	} {
		if !series[want] {
			t.Errorf("no series %s after Init", want)
		}
	}
	m.ObserveStep("t", "charge", "ran")
	series = map[string]bool{}
	families, _ = m.Registry.Gather()
	for _, f := range families {
		for _, s := range f.GetMetric() {
			if f.GetName() == "idemq_steps_total" && s.GetCounter().GetValue() == 0 {
				series[fmt.Sprint(s.GetLabel())] = true
			}
		}
	}
	if len(series) != 1 {
		t.Errorf("after a step ran, %d step series at zero, want its mismatch series", len(series))
	}
	// The bound children are the vectors' own: an event counts into the series Init made.
	m.ObserveLedger("mismatch", "t")
	if got := fmt.Sprint(counterValue(t, m, "idemq_ledger_events_total", "mismatch")); got != "1" {
		t.Errorf("mismatch after one event = %s, want 1", got)
	}
}

func counterValue(t *testing.T, m *Metrics, name, event string) float64 {
	t.Helper()
	families, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, s := range f.GetMetric() {
			for _, l := range s.GetLabel() {
				if l.GetName() == "event" && l.GetValue() == event {
					return s.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("no %s{event=%q}", name, event)
	return 0
}
