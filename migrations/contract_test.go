package migrations_test

import (
	"errors"
	"strings"
	"testing"
	"testing/fstest"
	"time"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/migrations"
)

// Every shipped migration's mark parses, and the schema version is the last core one.
func TestShippedStepsParse(t *testing.T) {
	core, err := migrations.ReadSteps(migrations.CoreFS())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := migrations.ReadSteps(migrations.TheExampleFS()); err != nil {
		t.Fatal(err)
	}
	if got, want := migrations.SchemaVersion(), core[len(core)-1].Version; got != want || want < 110 {
		t.Fatalf("SchemaVersion() = %d, want the last core migration %d (at least 110, idemq_processes)", got, want)
	}
}

func TestContractMark(t *testing.T) {
	for _, tc := range []struct {
		sql      string
		contract bool
		requires int64
		err      string
	}{
		{"-- +goose Up\nCREATE TABLE a (x int);", false, 0, ""},
		{"-- +goose Up\n-- idemq: contract requires-schema=5\nALTER TABLE a DROP COLUMN x;", true, 5, ""},
		{"-- idemq: contract requires-schema=5\n-- +goose Up\nALTER TABLE a DROP COLUMN x;", true, 5, ""},
		// After the first statement it is no mark: the header is the leading comments.
		{"-- +goose Up\nSELECT 1;\n-- idemq: contract requires-schema=5\n", false, 0, ""},
		{"-- +goose Up\n-- idemq: contract\n", false, 0, "the only mark is"},
		{"-- +goose Up\n-- idemq: contract requires-schema=7\n", false, 0, "below the step's own (7)"},
		{"-- +goose Up\n-- idemq: expand\n", false, 0, "the only mark is"},
	} {
		steps, err := migrations.ReadSteps(fstest.MapFS{"00007_x.sql": {Data: []byte(tc.sql)}})
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: err %v, want one containing %q", tc.sql, err, tc.err)
			}
			continue
		}
		if err != nil || len(steps) != 1 || steps[0].Contract != tc.contract || steps[0].RequiresSchema != tc.requires {
			t.Errorf("%q: %+v, %v; want contract %v requires %d", tc.sql, steps, err, tc.contract, tc.requires)
		}
	}
}

// A contract step waits while a process older than it requires heartbeats; nothing of
// the run is applied. A process at the required schema, or one silent past the live
// window, does not hold it back.
func TestContractStepWaitsForOlderProcesses(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	dsn := testenv.PostgresURL(t)
	pool := testenv.Pool(t, dsn)
	db := testenv.OpenDB(t, dsn)
	files := fstest.MapFS{
		"00001_synth.sql":  {Data: []byte("-- +goose Up\nCREATE TABLE synth (a int, b int);\n")},
		"00002_expand.sql": {Data: []byte("-- +goose Up\nALTER TABLE synth ADD COLUMN c int;\n")},
		"00003_drop_b.sql": {Data: []byte("-- +goose Up\n-- idemq: contract requires-schema=2\nALTER TABLE synth DROP COLUMN b;\n")},
	}
	testenv.Exec(t, pool, `INSERT INTO idemq_processes (id, role, version, commit, schema_version, host, pid)
		VALUES (gen_random_uuid(), 'worker', 'v0.1.0', 'af04e0e', 1, 'old-host', 4242),
		       (gen_random_uuid(), 'api', 'devel', 'f77cb54', 2, 'new-host', 7)`)

	_, err := migrations.UpFiles(ctx, db, files, "synth_db_version")
	var ce *migrations.ContractError
	if !errors.As(err, &ce) {
		t.Fatalf("Up with an older live process: %v, want a *ContractError", err)
	}
	if ce.Step.Version != 3 || len(ce.Blocking) != 1 || ce.Blocking[0].Host != "old-host" {
		t.Fatalf("refused %+v, blocked by %+v; want step 3 blocked by old-host only", ce.Step, ce.Blocking)
	}
	for _, want := range []string{"00003_drop_b.sql", "worker old-host/4242 (version v0.1.0, schema 1)", "nothing was applied"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("message does not name %q: %v", want, err)
		}
	}
	if n := testenv.Count(t, pool, "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename = 'synth'"); n != 0 {
		t.Fatalf("the refused run applied its expand steps too (table synth exists)")
	}

	// The old process's heartbeat ages past the live window: it no longer counts.
	testenv.Exec(t, pool, "UPDATE idemq_processes SET heartbeat_at = now() - interval '3 minutes' WHERE host = 'old-host'")
	res, err := migrations.UpFiles(ctx, db, files, "synth_db_version")
	if err != nil || len(res) != 3 {
		t.Fatalf("Up once the old process is silent: %d applied, %v; want 3", len(res), err)
	}
	if n := testenv.Count(t, pool, "SELECT count(*) FROM information_schema.columns WHERE table_schema = current_schema() AND table_name = 'synth' AND column_name = 'b'"); n != 0 {
		t.Fatal("the contract step did not run: synth.b is still there")
	}
}
