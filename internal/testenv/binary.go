package testenv

import (
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
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s not found; under CI it must be installed (%s)", name, hint)
	}
	t.Skipf("%s not found: %s to run this test", name, hint)
}
