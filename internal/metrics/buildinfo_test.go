package metrics

import (
	"testing"

	"github.com/idemq/idemq/internal/release"
)

// idemq_build_info names the commit as `idemq version` does: "unknown" for a build
// without version control information (as test binaries are), never an empty label.
func TestBuildInfoCommit(t *testing.T) {
	t.Parallel()
	mfs, err := New().Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	want := release.Current().Revision()
	if want == "" {
		want = "unknown"
	}
	for _, mf := range mfs {
		if mf.GetName() != "idemq_build_info" {
			continue
		}
		for _, l := range mf.GetMetric()[0].GetLabel() {
			if l.GetName() == "commit" {
				if l.GetValue() != want {
					t.Fatalf("idemq_build_info{commit=%q}, want %q", l.GetValue(), want)
				}
				return
			}
		}
	}
	t.Fatal("no idemq_build_info{commit}")
}
