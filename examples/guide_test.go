package examples_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The guide's GORM handler builds from its text alone, in a scratch module outside the
// repository that imports idemq with a replace, as a user's module would: the block
// docs/guide.md marks with "scratch-check: gorm", nothing added. The scratch module takes
// this module's requirements (the versions the examples are tested with) and is built
// with the race detector, as the examples are, so that it reuses their build cache.
func TestGuideGormHandlerBuildsInAScratchModule(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a module of its own")
	}
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	guide, err := os.ReadFile(filepath.Join(root, "docs", "guide.md"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?s)<!-- scratch-check: gorm[^>]*-->\n```go\n(.*?)```").FindSubmatch(guide)
	if m == nil {
		t.Fatal(`docs/guide.md has no Go block marked "scratch-check: gorm"`)
	}
	code := m[1]
	if !bytes.Contains(code, []byte("server.HandleSQLTx")) || !bytes.Contains(code, []byte("gorm.Open")) {
		t.Fatalf("the guide's marked block is not a GORM handler registered with HandleSQLTx:\n%s", code)
	}
	mod, err := os.ReadFile("go.mod")
	if err != nil {
		t.Fatal(err)
	}
	sum, err := os.ReadFile("go.sum")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	gomod := strings.Replace(string(mod), "module github.com/idemq/idemq/examples", "module example.com/scratch", 1)
	gomod = strings.Replace(gomod, "github.com/idemq/idemq => ../", "github.com/idemq/idemq => "+root, 1)
	for name, data := range map[string][]byte{"go.mod": []byte(gomod), "go.sum": sum, "refund.go": code} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("go", "build", "-race", "./...")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("the guide's GORM handler does not build in a scratch module: %v\n%s\n--- refund.go:\n%s", err, out, code)
	}
}
