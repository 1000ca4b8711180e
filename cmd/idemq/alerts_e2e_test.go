package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemq/idemq/internal/metrics"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// TestAlertFiresAndResolves runs a real Prometheus (Debian's) against `idemq worker` and
// `idemq api` with the shipped alerting rules, scraping and evaluating every second. The
// copy of the rules it loads keeps every expression but shortens the windows ([15m],
// [1h] to [10s]) and the for: durations (to 1s). A plain asynq producer sends a debit
// whose key the ledger knows with another payload, the worker refuses it,
// IdemqPayloadMismatch fires, and it resolves once the window has passed. Last, it checks
// that every metric the rules and the Grafana dashboard use is in the binaries' /metrics.
func TestAlertFiresAndResolves(t *testing.T) {
	testenv.NeedBinary(t, "prometheus", "apt-get install prometheus")
	t.Parallel()
	dsn, rurl := testenv.PostgresURL(t), testenv.RedisURL(t)
	env := []string{"DATABASE_URL=" + dsn, "REDIS_URL=" + rurl, "IDEMQ_CONCURRENCY=2", "IDEMQ_FAKEPAY_URL=http://127.0.0.1:1"}
	workerAddr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	startIdemq(t, "worker", append([]string{"IDEMQ_METRICS_ADDR=" + workerAddr}, env...), "worker")
	api := startAPI(t, env)
	testenv.WaitHTTP(t, "http://"+workerAddr+"/readyz", 30*time.Second)
	apiAddr := strings.TrimPrefix(api, "http://")

	rules, err := os.ReadFile("../../deploy/prometheus/rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	dashboard, err := os.ReadFile("../../deploy/grafana/idemq.json")
	if err != nil {
		t.Fatal(err)
	}

	// Prometheus, on a port of its own, with a copy of the rules.
	dir := t.TempDir()
	short := regexp.MustCompile(`\[(15m|1h)\]`).ReplaceAllString(string(rules), "[10s]")
	short = regexp.MustCompile(`(?m)^(\s+for:) \S+$`).ReplaceAllString(short, "$1 1s")
	if err := os.WriteFile(filepath.Join(dir, "rules.yml"), []byte(short), 0o644); err != nil {
		t.Fatal(err)
	}
	config := fmt.Sprintf(`global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [rules.yml]
scrape_configs:
  - job_name: idemq-worker
    static_configs: [{targets: [%q]}]
  - job_name: idemq-api
    static_configs: [{targets: [%q]}]
`, workerAddr, apiAddr)
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	promAddr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	startPrometheus(t, dir, promAddr)
	prom := "http://" + promAddr

	waitFor(t, 20*time.Second, "both targets up", func() bool {
		var r struct {
			Data struct {
				ActiveTargets []struct{ Health string } `json:"activeTargets"`
			} `json:"data"`
		}
		promGet(t, prom+"/api/v1/targets", &r)
		up := 0
		for _, tg := range r.Data.ActiveTargets {
			if tg.Health == "up" {
				up++
			}
		}
		return up == 2
	})
	if s := alertState(t, prom, "IdemqPayloadMismatch"); s != "" {
		t.Fatalf("IdemqPayloadMismatch is %s before any mismatch", s)
	}

	// debit:r-1 completes, then a plain asynq producer sends the same key with another
	// account: a mismatch the worker refuses.
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: mustRedisAddr(t, rurl), DB: mustRedisDB(t, rurl)})
	t.Cleanup(func() { client.Close() })
	first, err := tasks.DebitSpec(tasks.Debit{AccountID: "a-1", AmountCents: 100, Reference: "r-1"})
	if err != nil {
		t.Fatal(err)
	}
	other, err := tasks.DebitSpec(tasks.Debit{AccountID: "a-other", AmountCents: 100, Reference: "r-1"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.Enqueue(first.Task(first.Key, time.Now())); err != nil {
		t.Fatal(err)
	}
	workerMetrics := "http://" + workerAddr + "/metrics"
	waitMetric(t, workerMetrics, ledgerEvent("completed", tasks.TypeDebit), func(v float64) bool { return v >= 1 })
	if _, err := client.Enqueue(other.Task(first.Key+"#other", time.Now())); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	waitFor(t, 15*time.Second, "IdemqPayloadMismatch firing", func() bool {
		return alertState(t, prom, "IdemqPayloadMismatch") == "firing"
	})
	fired := time.Since(start)
	if got := metricSum(t, workerMetrics, "idemq_ledger_events_total", `event="mismatch"`); got != 1 {
		t.Errorf("mismatches counted: %v, want 1", got)
	}
	// No new mismatch: once the 10 s window has passed, the alert resolves.
	waitFor(t, 25*time.Second, "IdemqPayloadMismatch resolved", func() bool {
		return alertState(t, prom, "IdemqPayloadMismatch") == ""
	})
	t.Logf("IdemqPayloadMismatch fired %s after the mismatch and resolved %s after it", fired.Round(100*time.Millisecond), time.Since(start).Round(100*time.Millisecond))

	// The rules and the dashboard use only metrics the binaries export: in their /metrics
	// (asynq's queue gauges appear once a queue exists), or, for a vector with no series
	// yet, described by their registry.
	exposed := exposedFamilies(t, "http://"+workerAddr+"/metrics", api+"/metrics")
	described := map[string]bool{}
	ch := make(chan *prometheus.Desc)
	go func() { metrics.New().Registry.Describe(ch); close(ch) }()
	for d := range ch {
		if m := regexp.MustCompile(`fqName: "([^"]+)"`).FindStringSubmatch(d.String()); m != nil {
			described[m[1]] = true
		}
	}
	used := 0
	onlyDescribed := map[string]bool{}
	for _, name := range regexp.MustCompile(`\b(?:idemq|asynq)_[a-z0-9_]+`).FindAllString(string(rules)+string(dashboard), -1) {
		used++
		family := regexp.MustCompile(`_(bucket|sum|count)$`).ReplaceAllString(name, "") // a histogram's series
		if !exposed[name] && !exposed[family] && (described[name] || described[family]) {
			onlyDescribed[family] = true
		}
		if !exposed[name] && !exposed[family] && !described[name] && !described[family] {
			t.Errorf("%s, used by the rules or the dashboard, is neither in the binaries' /metrics nor described by their registry", name)
		}
	}
	if used < 30 {
		t.Fatalf("found %d metric names in the rules and the dashboard", used)
	}
	t.Logf("%d metric names used; without a series in this run, found in the registry only: %v", used, slices.Sorted(maps.Keys(onlyDescribed)))
	// Only these wait for an event this run does not make: a recorded step (a checkout),
	// a periodic tick (served by idemq scheduler). Every other family has a series.
	for name := range onlyDescribed {
		if name != "idemq_steps_total" && name != "idemq_schedule_ticks_total" {
			t.Errorf("%s has no series in the binaries' /metrics", name)
		}
	}
}

// exposedFamilies returns the metric families (their # TYPE lines) of the scraped urls.
func exposedFamilies(t *testing.T, urls ...string) map[string]bool {
	t.Helper()
	names := map[string]bool{}
	for _, u := range urls {
		resp, err := http.Get(u)
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			if f := strings.Fields(sc.Text()); len(f) >= 3 && f[0] == "#" && f[1] == "TYPE" {
				names[f[2]] = true
			}
		}
		resp.Body.Close()
	}
	return names
}

// startPrometheus runs prometheus with dir's prometheus.yml on addr until the test ends.
func startPrometheus(t *testing.T, dir, addr string) {
	t.Helper()
	log, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("prometheus", "--config.file=prometheus.yml", "--storage.tsdb.path=data",
		"--web.listen-address="+addr, "--log.level=warn")
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); log.Close(); close(done) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-done
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(dir, "prometheus.log"))
			t.Logf("--- prometheus log ---\n%s", b)
		}
	})
	testenv.WaitHTTP(t, "http://"+addr+"/-/ready", 30*time.Second)
}

// alertState is the state of Prometheus's alert name (pending or firing), or "" when it
// is not active.
func alertState(t *testing.T, prom, name string) string {
	t.Helper()
	var r struct {
		Data struct {
			Alerts []struct {
				Labels map[string]string `json:"labels"`
				State  string            `json:"state"`
			} `json:"alerts"`
		} `json:"data"`
	}
	promGet(t, prom+"/api/v1/alerts", &r)
	for _, a := range r.Data.Alerts {
		if a.Labels["alertname"] == name {
			if a.Labels["task_type"] != tasks.TypeDebit || a.Labels["severity"] == "" {
				t.Errorf("%s has labels %v, want task_type %s and a severity", name, a.Labels, tasks.TypeDebit)
			}
			return a.State
		}
	}
	return ""
}

func promGet(t *testing.T, url string, v any) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("%s: %v", url, err)
	}
}

// waitFor polls ok every 250 ms until it holds, or fails the test after d naming what.
func waitFor(t *testing.T, d time.Duration, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("no %s after %s", what, d)
		}
		time.Sleep(250 * time.Millisecond)
	}
}
