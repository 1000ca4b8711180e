// Package release says which idemq this binary is: its version, commit and schema version,
// and the list of releases (RELEASES at the repository's root, embedded here).
//
// The version comes from the linker when the build sets it:
//
//	go build -ldflags "-X github.com/idemq/idemq/internal/release.version=v0.2.0 -X github.com/idemq/idemq/internal/release.commit=$(git rev-parse HEAD)" ./cmd/idemq
//
// and otherwise from the commit Go stamped into the binary (vcs.revision): a clean build of
// a release's commit is that release, anything else is "devel".
package release

import (
	_ "embed"
	"fmt"
	"regexp"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"

	"github.com/idemq/idemq/migrations"
)

// Set by the linker (-ldflags -X); empty otherwise.
var (
	version string
	commit  string
)

// Devel is the version of a build that is no release.
const Devel = "devel"

//go:embed RELEASES
var releasesFile string

// A Release is one line of RELEASES.
type Release struct {
	Version    string // v0.1.0
	Commit     string // abbreviated hash of the commit it was built from
	Schema     int64  // the highest core migration it embeds
	RunsBeside string // the oldest release whose processes may run beside it
}

var (
	versionRE = regexp.MustCompile(`^v(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$`)
	commitRE  = regexp.MustCompile(`^[0-9a-f]{7,40}$`)
)

// Parse reads a RELEASES file: '#' starts a comment; every other non-blank line is
// VERSION COMMIT SCHEMA RUNS-BESIDE, oldest release first. Versions and schema versions
// must grow from line to line, and RUNS-BESIDE must name this release or an earlier one.
func Parse(text string) ([]Release, error) {
	var out []Release
	seen := map[string]int{}
	for i, line := range strings.Split(text, "\n") {
		if j := strings.IndexByte(line, '#'); j >= 0 {
			line = line[:j]
		}
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		n := i + 1
		if len(f) != 4 {
			return nil, fmt.Errorf("RELEASES line %d: want 4 fields (VERSION COMMIT SCHEMA RUNS-BESIDE), got %d", n, len(f))
		}
		r := Release{Version: f[0], Commit: f[1], RunsBeside: f[3]}
		if !versionRE.MatchString(r.Version) {
			return nil, fmt.Errorf("RELEASES line %d: version %q is not vMAJOR.MINOR.PATCH", n, r.Version)
		}
		if !commitRE.MatchString(r.Commit) {
			return nil, fmt.Errorf("RELEASES line %d: commit %q is not 7 to 40 lower-case hex digits", n, r.Commit)
		}
		s, err := strconv.ParseInt(f[2], 10, 64)
		if err != nil || s < 1 {
			return nil, fmt.Errorf("RELEASES line %d: schema %q is not a migration version (a positive integer)", n, f[2])
		}
		r.Schema = s
		if len(out) > 0 {
			prev := out[len(out)-1]
			if !Less(prev.Version, r.Version) {
				return nil, fmt.Errorf("RELEASES line %d: %s does not come after %s: list releases oldest first", n, r.Version, prev.Version)
			}
			if r.Schema < prev.Schema {
				return nil, fmt.Errorf("RELEASES line %d: %s has schema %d, below %s's %d: a schema version never goes back", n, r.Version, r.Schema, prev.Version, prev.Schema)
			}
		}
		if _, ok := seen[r.RunsBeside]; !ok && r.RunsBeside != r.Version {
			return nil, fmt.Errorf("RELEASES line %d: %s runs beside %q, which is neither itself nor an earlier release", n, r.Version, r.RunsBeside)
		}
		seen[r.Version] = len(out)
		out = append(out, r)
	}
	return out, nil
}

// Less reports whether release version a comes before b (both vMAJOR.MINOR.PATCH).
func Less(a, b string) bool {
	pa, pb := versionRE.FindStringSubmatch(a), versionRE.FindStringSubmatch(b)
	if pa == nil || pb == nil {
		return false
	}
	for i := 1; i <= 3; i++ {
		x, _ := strconv.Atoi(pa[i])
		y, _ := strconv.Atoi(pb[i])
		if x != y {
			return x < y
		}
	}
	return false
}

// List returns the releases of the embedded RELEASES, oldest first.
func List() []Release {
	rs, err := Parse(releasesFile)
	if err != nil {
		panic(err) // a test parses the embedded file
	}
	return rs
}

// Build describes this binary.
type Build struct {
	Version   string // a release (v0.1.0), the linker's -X value, or Devel
	Commit    string // the commit built, or "" when unknown
	Modified  bool   // built from a work tree with uncommitted changes
	Schema    int64  // the highest core migration embedded (migrations.SchemaVersion)
	GoVersion string
}

// Current describes the running binary.
func Current() Build {
	b := Build{Version: version, Commit: commit, Schema: migrations.SchemaVersion(), GoVersion: runtime.Version()}
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				if b.Commit == "" {
					b.Commit = s.Value
				}
			case "vcs.modified":
				b.Modified = s.Value == "true"
			}
		}
	}
	if b.Version == "" {
		b.Version = lookup(List(), b.Commit, b.Modified)
	}
	return b
}

// lookup names the release built from commit, or Devel.
func lookup(rs []Release, commit string, modified bool) string {
	if commit == "" || modified {
		return Devel
	}
	for _, r := range rs {
		if strings.HasPrefix(commit, r.Commit) {
			return r.Version
		}
	}
	return Devel
}

// Revision is the commit, followed by "+modified" for a build of a work tree with
// uncommitted changes; "" when unknown.
func (b Build) Revision() string {
	if b.Modified && b.Commit != "" {
		return b.Commit + "+modified"
	}
	return b.Commit
}

// RevisionOrUnknown is Revision, or "unknown" for a build without version control
// information, for what must not be empty (a metric's label).
func (b Build) RevisionOrUnknown() string {
	if r := b.Revision(); r != "" {
		return r
	}
	return "unknown"
}

// String is the build on one line: "v0.1.0 (commit af04e0e6115a, schema 61, go1.26.8)".
func (b Build) String() string {
	c := b.Commit
	if c == "" {
		c = "unknown"
	} else if len(c) > 12 {
		c = c[:12]
	}
	if b.Modified {
		c += ", modified"
	}
	return fmt.Sprintf("%s (commit %s, schema %d, %s)", b.Version, c, b.Schema, b.GoVersion)
}
