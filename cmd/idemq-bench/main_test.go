package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

// -h names the environment idemq-bench reads and lists its flags, the child roles' and
// the binary's among them.
func TestHelpListsEnvironmentAndFlags(t *testing.T) {
	t.Parallel()
	var out, errOut bytes.Buffer
	if err := run(context.Background(), []string{"-h"}, &out, &errOut); err != nil {
		t.Fatalf("idemq-bench -h: %v\n%s", err, errOut.String())
	}
	for _, want := range []string{"REDIS_URL", "DATABASE_URL", "IDEMQ_LOG_LEVEL", "Usage: idemq-bench", "-drain", "-idemq", "-memory", "-write-docs", "-soak", "-soak-minutes"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("idemq-bench -h does not mention %s:\n%s", want, out.String())
		}
	}
}

// A bad setting stops the run before it measures anything, naming the variable.
func TestBadSettingStopsWithOneLine(t *testing.T) {
	t.Setenv("IDEMQ_LOG_LEVEL", "bogus")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out, errOut bytes.Buffer
	err := run(ctx, nil, &out, &errOut)
	if err == nil {
		t.Fatal("run with IDEMQ_LOG_LEVEL=bogus: nil error, want a refusal")
	}
	if msg := err.Error(); strings.Contains(msg, "\n") || !strings.Contains(msg, "IDEMQ_LOG_LEVEL") || !strings.Contains(msg, `"bogus"`) {
		t.Errorf("error %q, want one line naming IDEMQ_LOG_LEVEL and \"bogus\"", msg)
	}
	if out.Len() != 0 {
		t.Errorf("stdout %q, want nothing", out.String())
	}
}
