package main

import (
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/config"
	"github.com/idemq/idemq/tasks"
)

// A worker refuses a retention its tasks could outlive, naming the variables the bound is
// made of, before it connects to anything (no Redis or Postgres here). A busy budget below
// two leases is raised to it, and the bound with it.
func TestWorkerRefusesRetentionItsTasksOutlive(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env  []string
		want string
	}{
		{[]string{"IDEMQ_RETENTION=5m"}, "IDEMQ_RETENTION=5m0s is shorter than"},
		{[]string{"IDEMQ_RETENTION=5m"}, "IDEMQ_TASK_RETENTION=24h0m0s, IDEMQ_TASK_MAX_RETRY=10, IDEMQ_BUSY_BUDGET=15m0s"},
		{[]string{"IDEMQ_RETENTION=104s", "IDEMQ_TASK_RETENTION=1s", "IDEMQ_TASK_MAX_RETRY=1", "IDEMQ_BUSY_BUDGET=10s"},
			"IDEMQ_BUSY_BUDGET=1m0s: 1m45s)"},
		{[]string{"IDEMQ_RETENTION=58s", "IDEMQ_TASK_RETENTION=1s", "IDEMQ_TASK_MAX_RETRY=1", "IDEMQ_LEASE=7s", "IDEMQ_BUSY_BUDGET=1s"},
			"IDEMQ_BUSY_BUDGET=14s: 59s)"},
		{[]string{"IDEMQ_RETENTION=3m57s", "IDEMQ_TASK_RETENTION=1m", "IDEMQ_TASK_MAX_RETRY=2", "IDEMQ_BUSY_BUDGET=1m"},
			"IDEMQ_TASK_RETENTION=1m0s, IDEMQ_TASK_MAX_RETRY=2, IDEMQ_BUSY_BUDGET=1m0s: 3m58s)"},
		{[]string{"IDEMQ_TASK_MAX_RETRY=51"}, "IDEMQ_TASK_MAX_RETRY"},
		// The server takes a zero as its default (24h, 25 retries): the least is 1s and 1.
		{[]string{"IDEMQ_TASK_MAX_RETRY=0"}, "IDEMQ_TASK_MAX_RETRY: must be between 1 and 50, got 0"},
		{[]string{"IDEMQ_TASK_RETENTION=0s"}, "IDEMQ_TASK_RETENTION: must be at least 1s"},
	} {
		_, stderr, err := idemq(t, tc.env, "worker")
		if err == nil {
			t.Fatalf("%s: exit 0, want a refusal", tc.env)
		}
		if lines := strings.Split(strings.TrimSpace(stderr), "\n"); len(lines) != 1 || !strings.Contains(lines[0], tc.want) {
			t.Errorf("%s: stderr %q, want one line containing %q", tc.env, stderr, tc.want)
		}
	}
}

// The worker's task bounds default to what idemq's own producers enqueue with.
func TestWorkerTaskBoundsDefaultToTheExampleTasks(t *testing.T) {
	t.Parallel()
	typ := reflect.TypeOf(config.Worker{})
	f, _ := typ.FieldByName("TaskRetention")
	if d, err := time.ParseDuration(f.Tag.Get("default")); err != nil || d != tasks.DefaultRetention {
		t.Errorf("IDEMQ_TASK_RETENTION default %q, want %s", f.Tag.Get("default"), tasks.DefaultRetention)
	}
	f, _ = typ.FieldByName("TaskMaxRetry")
	if n, err := strconv.Atoi(f.Tag.Get("default")); err != nil || n != tasks.DefaultMaxRetry {
		t.Errorf("IDEMQ_TASK_MAX_RETRY default %q, want %d", f.Tag.Get("default"), tasks.DefaultMaxRetry)
	}
}
