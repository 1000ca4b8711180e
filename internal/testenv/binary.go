package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// NeedBinary skips the test when the named program is not installed (on PATH, in
// Debian's Postgres directories or in /usr/sbin), except under CI (CI=true), where a
// missing program fails it: hint says how to install it.
func NeedBinary(t testing.TB, name, hint string) {
	t.Helper()
	if _, err := exec.LookPath(name); err == nil {
		return
	}
	for _, dir := range []string{"/usr/lib/postgresql/*/bin/", "/usr/sbin/"} {
		if m, _ := filepath.Glob(dir + name); len(m) > 0 {
			return
		}
	}
	SkipMissing(t, name, hint)
}

// SkipMissing skips the test for want of the named program, or fails it under CI
// (CI=true), where every program a test needs must be installed. The skip is also
// appended to the file IDEMQ_SKIP_LOG names, one line "name\thint", so that `make test`
// can print one summary line of what it skipped and why (go test shows a skip's reason
// only with -v).
func SkipMissing(t testing.TB, name, hint string) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s not found; under CI it must be installed (%s)", name, hint)
	}
	if path := os.Getenv("IDEMQ_SKIP_LOG"); path != "" {
		// One short O_APPEND write per skip: lines from parallel test processes do not mix.
		if f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644); err == nil {
			fmt.Fprintf(f, "%s\t%s\n", name, hint)
			f.Close()
		}
	}
	t.Skipf("%s not found: %s to run this test", name, hint)
}
