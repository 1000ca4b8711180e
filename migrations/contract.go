package migrations

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"time"
)

// ProcessesTable is where idemq's long-running processes register (migration 00110).
const ProcessesTable = "idemq_processes"

// LiveWindow is how recent a registered process's heartbeat must be for it to count as
// alive: processes heartbeat about every 15 s.
const LiveWindow = 2 * time.Minute

// A Process is a row of idemq_processes.
type Process struct {
	ID, Role, Host  string
	PID             int
	Version, Commit string
	Schema          int64
	StartedAt       time.Time
	HeartbeatAt     time.Time
}

// LiveProcesses returns the registered processes that heartbeated within LiveWindow (by
// the database's clock), oldest schema first; none when the schema has no
// idemq_processes table yet. Processes of releases older than that table are not there.
func LiveProcesses(ctx context.Context, db *sql.DB) ([]Process, error) {
	var exists bool
	if err := db.QueryRowContext(ctx, "SELECT "+relation(ProcessesTable)+" IS NOT NULL").Scan(&exists); err != nil {
		return nil, fmt.Errorf("migrations: read %s: %w", ProcessesTable, err)
	}
	if !exists {
		return nil, nil
	}
	rows, err := db.QueryContext(ctx, `SELECT id::text, role, host, pid, version, commit, schema_version, started_at, heartbeat_at
		FROM `+ProcessesTable+` WHERE heartbeat_at > now() - make_interval(secs => $1)
		ORDER BY schema_version, host, pid`, LiveWindow.Seconds())
	if err != nil {
		return nil, fmt.Errorf("migrations: read %s: %w", ProcessesTable, err)
	}
	defer rows.Close()
	var out []Process
	for rows.Next() {
		var p Process
		if err := rows.Scan(&p.ID, &p.Role, &p.Host, &p.PID, &p.Version, &p.Commit, &p.Schema, &p.StartedAt, &p.HeartbeatAt); err != nil {
			return nil, fmt.Errorf("migrations: read %s: %w", ProcessesTable, err)
		}
		out = append(out, p)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("migrations: read %s: %w", ProcessesTable, err)
	}
	return out, nil
}

// A ContractError is a pending contract step refused because live processes run a schema
// older than it requires: they may still use what it removes.
type ContractError struct {
	Set      string // "core" or "example"
	Step     Step
	Blocking []Process
}

func (e *ContractError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "migrations: refusing contract step %s (%s set): it needs every live process at schema %d or later, and %d process(es) that heartbeated within %s run an older one:",
		e.Step.Path, e.Set, e.Step.RequiresSchema, len(e.Blocking), LiveWindow)
	for _, p := range e.Blocking {
		fmt.Fprintf(&b, " %s %s/%d (version %s, schema %d);", p.Role, p.Host, p.PID, p.Version, p.Schema)
	}
	b.WriteString(" stop or upgrade them (a stopped process deletes its row; a killed one stops counting " +
		LiveWindow.String() + " after its last heartbeat), then migrate again; nothing was applied (docs/releases.md)")
	return b.String()
}

// check returns a *ContractError when a pending contract step of s may not run yet. A set
// without contract steps costs no query. It only reads.
func (s *set) check(ctx context.Context, db *sql.DB) error {
	steps, err := readSteps(s.files)
	if err != nil {
		return err
	}
	if !slices.ContainsFunc(steps, func(st Step) bool { return st.Contract }) {
		return nil
	}
	list, err := s.status(ctx, db)
	if err != nil {
		return err
	}
	var pending []Step
	for _, m := range list {
		if !m.Applied {
			pending = append(pending, m.Step)
		}
	}
	return s.checkContracts(ctx, db, pending)
}

// checkContracts returns a *ContractError for the first pending contract step a live
// process is too old for, or nil. It reads idemq_processes only when a contract step is
// pending.
func (s *set) checkContracts(ctx context.Context, db *sql.DB, pending []Step) error {
	var live []Process
	read := false
	for _, step := range pending {
		if !step.Contract {
			continue
		}
		if !read {
			var err error
			if live, err = LiveProcesses(ctx, db); err != nil {
				return err
			}
			read = true
		}
		var blocking []Process
		for _, p := range live {
			if p.Schema < step.RequiresSchema {
				blocking = append(blocking, p)
			}
		}
		if len(blocking) > 0 {
			return &ContractError{Set: s.name, Step: step, Blocking: blocking}
		}
	}
	return nil
}
