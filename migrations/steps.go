package migrations

import (
	"fmt"
	"io/fs"
	"path"
	"strconv"
	"strings"
	"sync"

	"github.com/pressly/goose/v3"
)

// A Step is one migration file and its place in the expand/contract rule.
//
// A migration is an expand step unless its header says otherwise: it only adds (a table,
// a nullable column, an index, a NOT VALID constraint), so the binaries of earlier
// releases keep working on the schema it leaves. A contract step removes or narrows
// what an earlier release may still use, and says so in a comment line before its SQL,
// with the schema version every live process must have reached before it runs:
//
//	-- idemq: contract requires-schema=120
//
// Up refuses a pending contract step while a process registered in idemq_processes with a
// lower schema version has heartbeated within LiveWindow (see ContractError).
type Step struct {
	Version int64
	Path    string // the file's name in its set: 00001_processed_jobs.sql
	// Contract marks a contract step; RequiresSchema is then the lowest schema version a
	// live process may have while it is applied.
	Contract       bool
	RequiresSchema int64
}

// Kind is "contract" or "expand".
func (s Step) Kind() string {
	if s.Contract {
		return "contract"
	}
	return "expand"
}

const markPrefix = "-- idemq:"

// readSteps reads the steps of the *.sql files of fsys, in version order.
func readSteps(fsys fs.FS) ([]Step, error) {
	names, err := fs.Glob(fsys, "*.sql")
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	var out []Step
	for _, name := range names { // fs.Glob sorts; the versions are zero-padded
		v, err := goose.NumericComponent(path.Base(name))
		if err != nil {
			return nil, fmt.Errorf("migrations: %s: %w", name, err)
		}
		b, err := fs.ReadFile(fsys, name)
		if err != nil {
			return nil, fmt.Errorf("migrations: %w", err)
		}
		st, err := parseMark(name, v, string(b))
		if err != nil {
			return nil, err
		}
		out = append(out, st)
	}
	return out, nil
}

// parseMark reads the "-- idemq:" lines of a migration's leading comments.
func parseMark(name string, version int64, sql string) (Step, error) {
	st := Step{Version: version, Path: name}
	for _, line := range strings.Split(sql, "\n") {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		if !strings.HasPrefix(line, "--") {
			break // the header ends at the first statement
		}
		if !strings.HasPrefix(line, markPrefix) {
			continue
		}
		f := strings.Fields(strings.TrimPrefix(line, markPrefix))
		if len(f) != 2 || f[0] != "contract" || !strings.HasPrefix(f[1], "requires-schema=") {
			return st, fmt.Errorf("migrations: %s: %q: the only mark is %q", name, line, markPrefix+" contract requires-schema=N")
		}
		n, err := strconv.ParseInt(strings.TrimPrefix(f[1], "requires-schema="), 10, 64)
		if err != nil || n < 1 || n >= version {
			return st, fmt.Errorf("migrations: %s: requires-schema must be a schema version below the step's own (%d), got %q", name, version, f[1])
		}
		if st.Contract {
			return st, fmt.Errorf("migrations: %s: more than one %q line", name, markPrefix)
		}
		st.Contract, st.RequiresSchema = true, n
	}
	return st, nil
}

var schemaVersion = sync.OnceValue(func() int64 {
	steps, err := readSteps(coreFiles)
	if err != nil || len(steps) == 0 {
		panic(fmt.Sprintf("migrations: the embedded core set: %v", err)) // a test reads it
	}
	return steps[len(steps)-1].Version
})

// SchemaVersion is the highest core migration embedded in this binary: the schema version
// its processes register with and expect.
func SchemaVersion() int64 { return schemaVersion() }
