package release

import (
	"os"
	"os/exec"
	"path"
	"strconv"
	"strings"
	"testing"

	"github.com/pressly/goose/v3"
)

// The binary embeds a copy of the repository's RELEASES: the two must not drift.
func TestEmbeddedCopyIsTheRootFile(t *testing.T) {
	root, err := os.ReadFile("../../RELEASES")
	if err != nil {
		t.Fatal(err)
	}
	if string(root) != releasesFile {
		t.Fatal("internal/release/RELEASES differs from RELEASES at the repository's root: copy the root file over it (cp RELEASES internal/release/)")
	}
	if len(List()) == 0 {
		t.Fatal("RELEASES lists no release")
	}
}

func TestParseRefusesMalformedLines(t *testing.T) {
	for _, tc := range []struct{ text, want string }{
		{"v0.1.0 af04e0e 61", "want 4 fields"},
		{"0.1.0 af04e0e 61 0.1.0", "not vMAJOR.MINOR.PATCH"},
		{"v0.1.0 AF04E0E 61 v0.1.0", "not 7 to 40 lower-case hex"},
		{"v0.1.0 af04e0e x61 v0.1.0", "not a migration version"},
		{"v0.2.0 af04e0e 61 v0.2.0\nv0.1.0 af04e0f 70 v0.1.0", "does not come after"},
		{"v0.1.0 af04e0e 61 v0.1.0\nv0.1.1 af04e0f 60 v0.1.0", "never goes back"},
		{"v0.1.0 af04e0e 61 v0.1.0\nv0.2.0 af04e0f 70 v0.3.0", "neither itself nor an earlier release"},
	} {
		if _, err := Parse(tc.text); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Parse(%q) = %v, want an error containing %q", tc.text, err, tc.want)
		}
	}
	rs, err := Parse("# comment\n\nv0.1.0 af04e0e 61 v0.1.0 # first\nv0.10.0 0123456789abcdef 110 v0.1.0\n")
	if err != nil || len(rs) != 2 || rs[1] != (Release{"v0.10.0", "0123456789abcdef", 110, "v0.1.0"}) {
		t.Fatalf("Parse = %+v, %v", rs, err)
	}
}

func TestLookupNamesOnlyACleanReleaseBuild(t *testing.T) {
	rs := []Release{{"v0.1.0", "af04e0e", 61, "v0.1.0"}}
	for _, tc := range []struct {
		commit   string
		modified bool
		want     string
	}{
		{"af04e0e6115ab283223432ce3a322e7b987e88b9", false, "v0.1.0"},
		{"af04e0e6115ab283223432ce3a322e7b987e88b9", true, Devel},
		{"f77cb54000000000000000000000000000000000", false, Devel},
		{"", false, Devel},
	} {
		if got := lookup(rs, tc.commit, tc.modified); got != tc.want {
			t.Errorf("lookup(%q, modified %v) = %q, want %q", tc.commit, tc.modified, got, tc.want)
		}
	}
}

// Each release's line must say what its commit holds: SCHEMA is the highest migration in
// the commit's migrations/ directory.
func TestReleasesMatchHistory(t *testing.T) {
	if _, err := exec.Command("git", "rev-parse", "--git-dir").Output(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("no git history (%v): under CI the checkout must include it (fetch-depth: 0)", err)
		}
		t.Skipf("no git history here (%v): RELEASES is checked against it where there is one", err)
	}
	for _, r := range List() {
		out, err := exec.Command("git", "ls-tree", "--full-tree", "--name-only", r.Commit, "migrations/").Output()
		if err != nil {
			t.Errorf("%s: commit %s is not in this repository's history: %v", r.Version, r.Commit, err)
			continue
		}
		var top int64
		for _, name := range strings.Fields(string(out)) {
			if !strings.HasSuffix(name, ".sql") {
				continue
			}
			if v, err := goose.NumericComponent(path.Base(name)); err == nil && v > top {
				top = v
			}
		}
		if top != r.Schema {
			t.Errorf("%s: RELEASES says schema %d, its commit %s holds migrations up to %s", r.Version, r.Schema, r.Commit, strconv.FormatInt(top, 10))
		}
	}
}

// What the linker sets (-X …release.version, …release.commit) wins over the stamped
// commit.
func TestLinkerValuesWin(t *testing.T) {
	defer func(v, c string) { version, commit = v, c }(version, commit)
	version, commit = "v9.8.7", "0123456789abcdef0123456789abcdef01234567"
	b := Current()
	if b.Version != "v9.8.7" || b.Commit != commit || b.Schema < 110 {
		t.Fatalf("Current() = %+v, want the linker's version and commit and the embedded schema", b)
	}
	if s := b.String(); s != "v9.8.7 (commit 0123456789ab, schema "+strconv.FormatInt(b.Schema, 10)+", "+b.GoVersion+")" {
		t.Fatalf("String() = %q", s)
	}
}

// RevisionOrUnknown is what a label shows: never empty.
func TestRevisionOrUnknown(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		b    Build
		want string
	}{
		{Build{}, "unknown"},
		{Build{Commit: "af04e0e6115a"}, "af04e0e6115a"},
		{Build{Commit: "af04e0e6115a", Modified: true}, "af04e0e6115a+modified"},
	} {
		if got := tc.b.RevisionOrUnknown(); got != tc.want {
			t.Errorf("%+v: %q, want %q", tc.b, got, tc.want)
		}
	}
}
