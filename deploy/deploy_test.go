package deploy

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.yaml.in/yaml/v3"

	"github.com/idemq/idemq/internal/metrics"
	"github.com/idemq/idemq/internal/testenv"
)

// promtool runs Debian's promtool (package prometheus) with args in dir; without it the
// test skips, or fails under CI.
func promtool(t *testing.T, dir string, args ...string) string {
	t.Helper()
	testenv.NeedBinary(t, "promtool", "apt-get install prometheus")
	cmd := exec.Command("promtool", args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

func TestRulesPassPromtool(t *testing.T) {
	t.Parallel()
	out := promtool(t, "prometheus", "check", "rules", "rules.yml")
	if !strings.Contains(out, fmt.Sprintf("%d rules found", len(readRules(t)))) {
		t.Errorf("promtool check rules found another number of rules than rules.yml has:\n%s", out)
	}
	promtool(t, "prometheus", "test", "rules", "rules_test.yml")
}

// rule is an alerting rule of rules.yml.
type rule struct {
	Alert       string            `yaml:"alert"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

func readRules(t *testing.T) []rule {
	t.Helper()
	var f struct {
		Groups []struct {
			Rules []rule `yaml:"rules"`
		} `yaml:"groups"`
	}
	raw, err := os.ReadFile("prometheus/rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, &f); err != nil {
		t.Fatal(err)
	}
	var rules []rule
	for _, g := range f.Groups {
		rules = append(rules, g.Rules...)
	}
	if len(rules) < 10 {
		t.Fatalf("rules.yml has %d rules", len(rules))
	}
	return rules
}

// Every alert has a severity, a summary, a description and a runbook_url whose anchor is a
// section of docs/runbook.md; every section is an alert's; and rules_test.yml has a case
// where the alert fires and one where it stays quiet.
func TestAlertsAreDocumentedAndTested(t *testing.T) {
	t.Parallel()
	runbook, err := os.ReadFile("../docs/runbook.md")
	if err != nil {
		t.Fatal(err)
	}
	sections := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^## +(.+?) *$`).FindAllStringSubmatch(string(runbook), -1) {
		sections[slugify(m[1])] = true
	}
	var tests struct {
		Tests []struct {
			AlertRuleTest []struct {
				Alertname string `yaml:"alertname"`
				ExpAlerts []any  `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	raw, err := os.ReadFile("prometheus/rules_test.yml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, &tests); err != nil {
		t.Fatal(err)
	}
	fires, quiet := map[string]bool{}, map[string]bool{}
	for _, tc := range tests.Tests {
		for _, a := range tc.AlertRuleTest {
			if len(a.ExpAlerts) > 0 {
				fires[a.Alertname] = true
			} else {
				quiet[a.Alertname] = true
			}
		}
	}
	const runbookURL = "https://github.com/idemq/idemq/blob/main/docs/runbook.md#"
	seen := map[string]bool{}
	for _, r := range readRules(t) {
		if r.Alert == "" {
			t.Errorf("rule %q is not an alert", r.Expr)
			continue
		}
		if !slices.Contains([]string{"critical", "warning", "info"}, r.Labels["severity"]) {
			t.Errorf("%s: severity %q, want critical, warning or info", r.Alert, r.Labels["severity"])
		}
		for _, a := range []string{"summary", "description", "runbook_url"} {
			if r.Annotations[a] == "" {
				t.Errorf("%s has no %s annotation", r.Alert, a)
			}
		}
		anchor, ok := strings.CutPrefix(r.Annotations["runbook_url"], runbookURL)
		switch {
		case !ok:
			t.Errorf("%s: runbook_url %q is not under %s", r.Alert, r.Annotations["runbook_url"], runbookURL)
		case anchor != strings.ToLower(r.Alert):
			t.Errorf("%s: runbook_url anchor %q, want the alert's name in lower case", r.Alert, anchor)
		case !sections[anchor]:
			t.Errorf("%s: docs/runbook.md has no section ## %s (anchor #%s)", r.Alert, r.Alert, anchor)
		}
		seen[anchor] = true
		if !fires[r.Alert] || !quiet[r.Alert] {
			t.Errorf("%s: rules_test.yml has a firing case: %v, a quiet case: %v; want both", r.Alert, fires[r.Alert], quiet[r.Alert])
		}
	}
	for s := range sections {
		if !seen[s] {
			t.Errorf("docs/runbook.md has a section #%s that no alert points to", s)
		}
	}
}

// dashboardExprs returns every query of the Grafana dashboard, with Grafana's interval
// variables replaced by durations Prometheus parses.
func dashboardExprs(t *testing.T) []string {
	t.Helper()
	raw, err := os.ReadFile("grafana/idemq.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Templating struct {
			List []struct{ Name, Type string }
		}
		Panels []struct {
			Type, Title string
			Targets     []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatal(err)
	}
	if len(d.Panels) == 0 || d.Panels[0].Type != "row" || d.Panels[0].Title != "Exactly-once" {
		t.Errorf("the dashboard's first panel is not the row Exactly-once")
	}
	if len(d.Templating.List) == 0 || d.Templating.List[0].Name != "datasource" || d.Templating.List[0].Type != "datasource" {
		t.Errorf("the dashboard has no datasource variable to choose the Prometheus at import")
	}
	if !strings.Contains(string(raw), `"uid": "${datasource}"`) {
		t.Errorf("the dashboard's panels do not use the datasource variable")
	}
	var exprs []string
	for _, p := range d.Panels {
		if p.Type != "row" && len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, q := range p.Targets {
			e := strings.NewReplacer("$__rate_interval", "5m", "$__interval", "1m", "$__range", "1h").Replace(q.Expr)
			if strings.Contains(e, "$") {
				t.Errorf("panel %q: query %q uses a variable the test cannot replace", p.Title, q.Expr)
			}
			exprs = append(exprs, e)
		}
	}
	if len(exprs) < 20 {
		t.Fatalf("found %d queries in the dashboard", len(exprs))
	}
	return exprs
}

// Every query of the dashboard parses: promtool checks them written as recording rules.
func TestDashboardQueriesPassPromtool(t *testing.T) {
	t.Parallel()
	exprs := dashboardExprs(t)
	type record struct {
		Record string `yaml:"record"`
		Expr   string `yaml:"expr"`
	}
	var rules []record
	for i, e := range exprs {
		rules = append(rules, record{Record: fmt.Sprintf("dashboard:query_%d", i), Expr: e})
	}
	raw, err := yaml.Marshal(map[string]any{"groups": []any{map[string]any{"name": "dashboard", "rules": rules}}})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "dashboard.yml"), raw, 0o644); err != nil {
		t.Fatal(err)
	}
	out := promtool(t, dir, "check", "rules", "dashboard.yml")
	if !strings.Contains(out, fmt.Sprintf("%d rules found", len(exprs))) {
		t.Errorf("promtool did not check every query:\n%s", out)
	}
}

// metricName finds the metric names in a query.
var metricName = regexp.MustCompile(`\b(?:idemq|asynq)_[a-z0-9_]+`)

// usedMetrics returns the idemq_ and asynq_ metric families the rules and the dashboard
// query, histogram series (_bucket, _sum, _count) by their family's name.
func usedMetrics(t *testing.T) map[string][]string {
	t.Helper()
	used := map[string][]string{}
	add := func(where, expr string) {
		for _, n := range metricName.FindAllString(expr, -1) {
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if base, ok := strings.CutSuffix(n, suffix); ok && strings.HasPrefix(n, "idemq_") && !strings.HasSuffix(base, "_total") {
					n = base
				}
			}
			used[n] = append(used[n], where)
		}
	}
	for _, r := range readRules(t) {
		add("rules.yml "+r.Alert, r.Expr)
	}
	for i, e := range dashboardExprs(t) {
		add(fmt.Sprintf("idemq.json query %d", i), e)
	}
	return used
}

// describedNames returns the metric families the worker's and the API's registries
// describe: metrics.New's and the collectors' they register (outbox, ledger, queues).
func describedNames() map[string]bool {
	names := map[string]bool{}
	ch := make(chan *prometheus.Desc)
	go func() {
		metrics.New().Registry.Describe(ch)
		metrics.NewOutboxCollector(nil, 0).Describe(ch)
		metrics.NewLedgerCollector(nil, 0).Describe(ch)
		metrics.NewQueueCollector(nil).Describe(ch)
		close(ch)
	}()
	fq := regexp.MustCompile(`fqName: "([^"]+)"`)
	for d := range ch {
		if m := fq.FindStringSubmatch(d.String()); m != nil {
			names[m[1]] = true
		}
	}
	return names
}

// Every metric the rules and the dashboard use is one idemq exports. (cmd/idemq's
// alert test also finds them in the running binaries' /metrics.)
func TestRulesAndDashboardUseExportedMetrics(t *testing.T) {
	t.Parallel()
	described := describedNames()
	used := usedMetrics(t)
	for name, where := range used {
		if !described[name] {
			t.Errorf("%s, used by %s, is not a metric idemq exports", name, strings.Join(where, ", "))
		}
	}
	for _, want := range []string{"idemq_ledger_needs_attention", "idemq_asynq_recovered_total", "idemq_handler_duration_seconds"} {
		if used[want] == nil {
			t.Errorf("neither the rules nor the dashboard use %s", want)
		}
	}
}

// slugify is GitHub's anchor for a heading (docs' link test has the same).
func slugify(h string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
			b.WriteRune(r)
		}
	}
	return b.String()
}

// The dashboard's panels have distinct ids and fit Grafana's 24-column grid without
// overlapping.
func TestDashboardLayout(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("grafana/idemq.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			ID      int
			Title   string
			GridPos struct{ H, W, X, Y int }
		}
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatal(err)
	}
	ids := map[int]bool{}
	cells := map[[2]int]string{}
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel %q: id %d is taken", p.Title, p.ID)
		}
		ids[p.ID] = true
		g := p.GridPos
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.X+g.W > 24 {
			t.Errorf("panel %q: gridPos %+v is off the 24-column grid", p.Title, g)
		}
		for x := g.X; x < g.X+g.W; x++ {
			for y := g.Y; y < g.Y+g.H; y++ {
				if other, ok := cells[[2]int{x, y}]; ok {
					t.Errorf("panels %q and %q overlap at (%d, %d)", other, p.Title, x, y)
					return
				}
				cells[[2]int{x, y}] = p.Title
			}
		}
	}
}
