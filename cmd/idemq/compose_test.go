package main

import (
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/idemq/idemq/idempotency/schedule"
	"github.com/idemq/idemq/internal/config"
)

// composeFile is the part of compose.yaml the test reads.
type composeFile struct {
	Services map[string]struct {
		Image           string            `yaml:"image"`
		Build           any               `yaml:"build"`
		Command         []string          `yaml:"command"`
		Environment     map[string]string `yaml:"environment"`
		Ports           []string          `yaml:"ports"`
		Volumes         []string          `yaml:"volumes"`
		Restart         string            `yaml:"restart"`
		StopGracePeriod string            `yaml:"stop_grace_period"`
		Healthcheck     *struct {
			Test []string `yaml:"test"`
		} `yaml:"healthcheck"`
		Deploy struct {
			Replicas int `yaml:"replicas"`
		} `yaml:"deploy"`
		DependsOn map[string]struct {
			Condition string `yaml:"condition"`
		} `yaml:"depends_on"`
	} `yaml:"services"`
	Volumes map[string]any `yaml:"volumes"`
}

// TestComposeFile checks compose.yaml against the design and the code: the services, the
// Redis settings that keep queues safe, the start order, the replicas and grace period,
// and that every variable it sets is one the service's command reads.
func TestComposeFile(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../../compose.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var c composeFile
	if err := yaml.Unmarshal(raw, &c); err != nil {
		t.Fatalf("compose.yaml: %v", err)
	}
	var names []string
	for name := range c.Services {
		names = append(names, name)
	}
	slices.Sort(names)
	if want := []string{"api", "fakepay", "migrate", "postgres", "redis", "scheduler", "worker"}; !slices.Equal(names, want) {
		t.Fatalf("services %v, want %v", names, want)
	}

	redis := c.Services["redis"]
	cmd := strings.Join(redis.Command, " ")
	for _, want := range []string{"--appendonly yes", "--maxmemory-policy noeviction"} {
		if !strings.Contains(cmd, want) {
			t.Errorf("redis command %q lacks %q", cmd, want)
		}
	}
	for _, name := range []string{"redis", "postgres", "fakepay", "worker", "api", "scheduler"} {
		if c.Services[name].Healthcheck == nil || len(c.Services[name].Healthcheck.Test) == 0 {
			t.Errorf("%s has no healthcheck", name)
		}
	}
	if len(c.Services["postgres"].Volumes) == 0 || len(c.Services["redis"].Volumes) == 0 {
		t.Error("postgres and redis must keep their data in volumes")
	}
	if m := c.Services["migrate"]; m.Restart != "no" || !slices.Equal(m.Command, []string{"migrate"}) {
		t.Errorf("migrate: restart %q command %v, want a one-shot `migrate`", m.Restart, m.Command)
	}
	if dep := c.Services["migrate"].DependsOn["postgres"].Condition; dep != "service_healthy" {
		t.Errorf("migrate waits for postgres with %q, want service_healthy", dep)
	}

	// The idemq services: each runs a subcommand, after the migration, with variables that
	// subcommand reads.
	specs := map[string]any{"worker": config.Worker{}, "api": config.API{}, "fakepay": config.Fakepay{}, "migrate": config.Migrate{},
		"scheduler": config.Scheduler{}}
	for name, spec := range specs {
		s := c.Services[name]
		if len(s.Command) == 0 {
			t.Errorf("%s: no command", name)
			continue
		}
		if _, ok := lookup(s.Command[0]); !ok {
			t.Errorf("%s runs `idemq %s`, which is not a subcommand", name, s.Command[0])
		}
		if name != "migrate" {
			if dep := s.DependsOn["migrate"].Condition; dep != "service_completed_successfully" {
				t.Errorf("%s waits for migrate with %q, want service_completed_successfully", name, dep)
			}
		}
		reads := envNames(reflect.TypeOf(spec))
		for v := range s.Environment {
			if !(strings.HasPrefix(v, "IDEMQ_") || v == "REDIS_URL" || v == "DATABASE_URL") {
				continue
			}
			if !slices.Contains(reads, v) && !sharedVar(v) {
				t.Errorf("%s sets %s, which `idemq %s` does not read (it reads %v)", name, v, s.Command[0], reads)
			}
		}
		for _, v := range []string{"REDIS_URL", "DATABASE_URL", "IDEMQ_FAKEPAY_URL"} {
			if slices.Contains(reads, v) && s.Environment[v] == "" {
				t.Errorf("%s reads %s but compose.yaml does not set it (the default points at 127.0.0.1)", name, v)
			}
		}
	}
	for _, name := range []string{"worker", "api", "scheduler"} {
		if dep := c.Services[name].DependsOn["redis"].Condition; dep != "service_healthy" {
			t.Errorf("%s waits for redis with %q, want service_healthy", name, dep)
		}
	}

	w := c.Services["worker"]
	if w.Deploy.Replicas != 3 {
		t.Errorf("worker replicas %d, want 3", w.Deploy.Replicas)
	}
	// Two schedulers, to show that replicas do not enqueue a tick twice; their file is
	// the example's, mounted where IDEMQ_SCHEDULE_FILE says.
	sc := c.Services["scheduler"]
	file := sc.Environment["IDEMQ_SCHEDULE_FILE"]
	if sc.Deploy.Replicas != 2 || file == "" || !slices.Contains(sc.Volumes, "./tasks/schedule.yaml:"+file+":ro") {
		t.Errorf("scheduler: replicas %d, IDEMQ_SCHEDULE_FILE %q, volumes %v: want 2 replicas reading the mounted tasks/schedule.yaml", sc.Deploy.Replicas, file, sc.Volumes)
	}
	if _, err := schedule.ReadFile("../../tasks/schedule.yaml"); err != nil {
		t.Errorf("the example schedule: %v", err)
	}
	// docker stop sends SIGTERM, then SIGKILL after the grace period: it must outlast the
	// drain (IDEMQ_SHUTDOWN_TIMEOUT) of the worker and of the api.
	for _, name := range []string{"worker", "api"} {
		s := c.Services[name]
		grace, err := time.ParseDuration(s.StopGracePeriod)
		if err != nil {
			t.Errorf("%s stop_grace_period %q: %v", name, s.StopGracePeriod, err)
			continue
		}
		shutdown := 30 * time.Second // config's default
		if v := s.Environment["IDEMQ_SHUTDOWN_TIMEOUT"]; v != "" {
			if shutdown, err = time.ParseDuration(v); err != nil {
				t.Fatalf("%s IDEMQ_SHUTDOWN_TIMEOUT %q: %v", name, v, err)
			}
		}
		if grace <= shutdown {
			t.Errorf("%s stop_grace_period %s is not above IDEMQ_SHUTDOWN_TIMEOUT %s: docker would SIGKILL mid-drain", name, grace, shutdown)
		}
	}
	if a := c.Services["api"]; !slices.Contains(a.Ports, "8080:8080") || a.Environment["IDEMQ_DASHBOARD_PASSWORD"] == "" {
		t.Errorf("api: ports %v, dashboard password %q: want 8080 published and the dashboard behind a password", a.Ports, a.Environment["IDEMQ_DASHBOARD_PASSWORD"])
	}
	// The API listens on all interfaces in its container: it needs a token, and compose
	// refuses to start without one rather than fall back on a placeholder.
	if tok := c.Services["api"].Environment["IDEMQ_API_TOKEN"]; !strings.HasPrefix(tok, "${IDEMQ_API_TOKEN:?") {
		t.Errorf("api: IDEMQ_API_TOKEN %q, want it required (${IDEMQ_API_TOKEN:?...})", tok)
	}
	if !strings.Contains(string(raw), "-H 'Content-Type: application/json'") || !strings.Contains(string(raw), `-H "Authorization: Bearer $IDEMQ_API_TOKEN"`) {
		t.Errorf("compose.yaml's curl example does not send the JSON Content-Type and the token")
	}
	if !slices.Contains(c.Services["fakepay"].Ports, "8090:8090") {
		t.Errorf("fakepay ports %v, want 8090", c.Services["fakepay"].Ports)
	}
}

// sharedVar is a variable of the shared environment block that some idemq services read
// and the others ignore.
func sharedVar(v string) bool {
	for _, spec := range []any{config.Worker{}, config.API{}, config.Fakepay{}, config.Migrate{}} {
		if slices.Contains(envNames(reflect.TypeOf(spec)), v) {
			return true
		}
	}
	return false
}
