package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/release"
)

// ReleaseBinary builds the binary of release r from the repository's history, once per
// commit (kept under os.TempDir, so later runs take a second). Without the history it
// skips the test, except under CI (CI=true), where it fails it.
func ReleaseBinary(t testing.TB, r release.Release) string {
	t.Helper()
	dir := filepath.Join(os.TempDir(), "idemq-releases", r.Commit)
	bin := filepath.Join(dir, "idemq")
	if _, err := os.Stat(bin); err == nil {
		return bin
	}
	if err := exec.Command("git", "cat-file", "-e", r.Commit+"^{commit}").Run(); err != nil {
		msg := fmt.Sprintf("commit %s of %s is not in this checkout's git history (%v): "+
			"the test builds that release from it (a shallow clone needs fetch-depth: 0)", r.Commit, r.Version, err)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	src, err := os.MkdirTemp(dir, "src-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(src)
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	archive := exec.CommandContext(ctx, "sh", "-c", `cd "$(git rev-parse --show-toplevel)" && git archive "$1" | tar -x -C "$2"`, "sh", r.Commit, src)
	if out, err := archive.CombinedOutput(); err != nil {
		t.Fatalf("extract %s: %v\n%s", r.Commit, err, out)
	}
	tmp := bin + ".tmp" + strconv.Itoa(os.Getpid())
	build := exec.CommandContext(ctx, "go", "build", "-o", tmp, "./cmd/idemq")
	build.Dir = src
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build %s (%s): %v\n%s", r.Version, r.Commit, err, out)
	}
	if err := os.Rename(tmp, bin); err != nil {
		t.Fatal(err)
	}
	t.Logf("built %s (%s) in %s", r.Version, r.Commit, time.Since(start).Round(time.Second))
	return bin
}
