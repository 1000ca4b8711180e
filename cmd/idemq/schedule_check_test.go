package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
)

// `idemq scheduler` refuses at its start what every tick of an entry would refuse, naming
// the entry and the field: a task type no worker of this binary serves, a payload its
// task refuses, a payload jsonb cannot store, a payload the tick's fields push over the
// limit, a max_retry out of range. It never starts to schedule such a file.
func TestSchedulerRefusesAtStartWhatEveryTickWouldRefuse(t *testing.T) {
	t.Parallel()
	env := []string{"DATABASE_URL=" + testenv.PostgresURL(t), "REDIS_URL=" + testenv.RedisURL(t), "IDEMQ_METRICS_ADDR="}
	pad := strings.Repeat("x", 65536-40)
	for _, c := range []struct{ entry, want string }{
		{"task_type: wallet:setle\n    payload: {period: 1m}", `entry "e": task_type: "wallet:setle"`},
		{"task_type: wallet:settle\n    payload: {period: soon}", `entry "e": payload: `},
		{"task_type: wallet:settle\n    payload: {period: 1m, note: \"a\\0b\"}", `entry "e": payload: a NUL character`},
		{"task_type: wallet:settle\n    payload: {period: 1m, pad: " + pad + "}", `entry "e": payload: `},
		{"task_type: wallet:settle\n    payload: {period: 1m}\n    max_retry: 4294967296", `entry "e": max_retry: 4294967296 is out of range`},
	} {
		file := filepath.Join(t.TempDir(), "schedule.yaml")
		yaml := "entries:\n  - name: ok\n    schedule: '@every 1m'\n    task_type: wallet:settle\n    payload: {period: 1m}\n" +
			"  - name: e\n    schedule: '@every 1m'\n    " + c.entry + "\n"
		if err := os.WriteFile(file, []byte(yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		cmd := exec.CommandContext(ctx, binary, "scheduler")
		cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "IDEMQ_SCHEDULE_FILE=" + file}, env...)
		out, err := cmd.CombinedOutput()
		timedOut := ctx.Err() != nil
		cancel()
		if timedOut || err == nil || !strings.Contains(string(out), c.want) {
			t.Errorf("%.60q: exit %v (timed out: %v), want it refused with %q; output:\n%.600s", c.entry, err, timedOut, c.want, out)
		}
	}
}

// `idemq scheduler -h` speaks of the scheduler's processes, not of workers.
func TestSchedulerHelpSpeaksOfItsOwnProcesses(t *testing.T) {
	t.Parallel()
	out, stderr, _ := idemq(t, nil, "scheduler", "-h")
	help := out + stderr
	if !strings.Contains(help, "IDEMQ_METRICS_ADDR") || strings.Contains(strings.ToLower(help), "worker") {
		t.Errorf("scheduler -h mentions a worker (or lacks IDEMQ_METRICS_ADDR):\n%s", help)
	}
}
