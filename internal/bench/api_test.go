package bench

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
)

// TestAPIModeTiny runs `idemq-bench -workloads api` briefly over every path, against an
// idemq binary built from this tree (the load generator is this test binary again): it
// checks that each path ran without an error, that every accepted request left its
// intent and that every e2e debit completed, never how fast.
func TestAPIModeTiny(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 3*time.Minute)
	dir := t.TempDir()
	binary := filepath.Join(dir, "idemq")
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", binary, "github.com/idemq/idemq/cmd/idemq").CombinedOutput(); err != nil {
		t.Fatalf("build idemq: %v\n%s", err, out)
	}
	jsonPath := filepath.Join(dir, "bench-api.json")
	var out, progress bytes.Buffer
	err := Main(ctx, envOr("REDIS_URL", testenv.DefaultRedisURL), envOr("DATABASE_URL", testenv.DefaultDatabaseURL),
		[]string{"-workloads", "api", "-reps", "1", "-api-seconds", "1", "-api-concurrency", "4",
			"-api-e2e-rate", "10", "-api-e2e-seconds", "1", "-api-binaries", binary, "-json", jsonPath}, &out, &progress)
	if err != nil {
		t.Fatalf("bench -workloads api: %v\nprogress:\n%s", err, progress.String())
	}
	b, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var rep APIReport
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatalf("decode %s: %v", jsonPath, err)
	}
	var paths []string
	for _, s := range rep.Samples {
		paths = append(paths, s.Path)
		if s.Requests <= 0 || s.Errors != 0 {
			t.Errorf("%s: %d requests, %d errors (first: %s)", s.Config, s.Requests, s.Errors, s.FirstError)
		}
		switch s.Path {
		case APIPathAPI, APIPathEnqueue, APIPathEnqueueTx:
			if s.Intents != s.Requests-s.Errors {
				t.Errorf("%s: %d intents for %d accepted requests", s.Config, s.Intents, s.Requests-s.Errors)
			}
		case APIPathE2E:
			// The sample fails unless every accepted debit completed.
			if s.Requests != 10 || s.E2EP50ms <= 0 || s.E2EMaxms < s.E2EP50ms {
				t.Errorf("e2e: %d debits, send to completion p50 %.1f ms max %.1f ms; want 10 debits, 0 < p50 <= max", s.Requests, s.E2EP50ms, s.E2EMaxms)
			}
		}
	}
	if !slices.Equal(paths, APIPathNames) {
		t.Errorf("paths = %v, want %v", paths, APIPathNames)
	}
	// Two headers, five throughput rows and the e2e row.
	var rows int
	for _, line := range strings.Split(out.String(), "\n") {
		if strings.HasPrefix(line, "| ") {
			rows++
		}
	}
	if rows != 8 {
		t.Errorf("tables have %d rows, want 8:\n%s", rows, out.String())
	}
}

// TestAPISustainTiny runs `idemq-bench -workloads api -api-sustain` for 20 s at 100
// debits per second, against an idemq binary built from this tree: it checks that samples
// were taken, that every accepted debit completed and took effect once, that the repeats
// got 200 and that no request failed, never how fast.
func TestAPISustainTiny(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 2*time.Minute)
	dir := t.TempDir()
	binary := filepath.Join(dir, "idemq")
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", binary, "github.com/idemq/idemq/cmd/idemq").CombinedOutput(); err != nil {
		t.Fatalf("build idemq: %v\n%s", err, out)
	}
	jsonPath := filepath.Join(dir, "bench-api-sustain.json")
	var out, progress bytes.Buffer
	err := Main(ctx, envOr("REDIS_URL", testenv.DefaultRedisURL), envOr("DATABASE_URL", testenv.DefaultDatabaseURL),
		[]string{"-workloads", "api", "-api-sustain", "20s", "-api-sustain-rate", "100", "-api-sustain-every", "5s",
			"-api-binaries", binary, "-json", jsonPath}, &out, &progress)
	if err != nil {
		t.Fatalf("bench -workloads api -api-sustain: %v\nprogress:\n%s\nout:\n%s", err, progress.String(), out.String())
	}
	b, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var rep APISustainReport
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatalf("decode %s: %v", jsonPath, err)
	}
	if len(rep.Runs) != 1 {
		t.Fatalf("%d runs, want 1", len(rep.Runs))
	}
	run := rep.Runs[0]
	if run.Requests != 2000 || run.Errors != 0 {
		t.Errorf("%d requests, %d errors (first: %s); want 2000, 0", run.Requests, run.Errors, run.FirstError)
	}
	if run.Codes["202"]+run.Codes["200"] != run.Requests || run.Codes["200"] == 0 {
		t.Errorf("answers %v: want only 202 and 200, some 200 (the repeats)", run.Codes)
	}
	// Samples at 5, 10, 15 and 20 s (the last may race the load's end), and the drained one.
	if n := len(run.Samples); n < 4 || !run.Samples[n-1].Drained {
		t.Errorf("%d samples, the last drained: %v; want at least 4", n, n > 0 && run.Samples[n-1].Drained)
	}
	for _, s := range run.Samples {
		if s.Accepted <= 0 || s.KeyRows <= 0 || s.APIRSSMiB <= 0 || s.WorkersRSSMiB <= 0 {
			t.Errorf("sample at %.1f s: accepted %d, key rows %d, api RSS %.1f MiB, workers RSS %.1f MiB; want all positive",
				s.Seconds, s.Accepted, s.KeyRows, s.APIRSSMiB, s.WorkersRSSMiB)
		}
	}
	c := run.Check
	if c == nil {
		t.Fatal("no check")
	}
	if len(c.Problems) != 0 || c.Accepted != run.Codes["202"] || c.Completed != c.Accepted || c.Entries != c.Accepted ||
		c.References != c.Accepted || c.Doubled != 0 || c.Missing != 0 {
		t.Errorf("check %+v: want every accepted reference completed with exactly one entry", c)
	}
	if !strings.Contains(out.String(), "| elapsed s |") || !strings.Contains(out.String(), "- check: each of the") {
		t.Errorf("output lacks the table or the check:\n%s", out.String())
	}
}
