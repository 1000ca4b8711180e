package main

import (
	"net"
	"regexp"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/testenv"
)

// A REDIS_URL that is not one says what one looks like.
func TestBadRedisURLShowsAnExample(t *testing.T) {
	t.Parallel()
	for _, url := range []string{"foo", "127.0.0.1:6379"} {
		_, stderr, err := idemq(t, []string{"REDIS_URL=" + url}, "worker")
		if err == nil || !strings.Contains(stderr, "REDIS_URL") || !strings.Contains(stderr, "redis://localhost:6379/0") {
			t.Errorf("REDIS_URL=%s: %v, stderr %q; want it to show redis://localhost:6379/0", url, err, stderr)
		}
	}
}

// An address in use names the variable that chose it.
func TestPortInUseNamesTheVariable(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	addr := ln.Addr().String()
	env := []string{"DATABASE_URL=" + testenv.PostgresURL(t), "REDIS_URL=" + testenv.RedisURL(t)}
	for _, tc := range []struct{ cmd, name string }{{"fakepay", "IDEMQ_FAKEPAY_ADDR"}, {"api", "IDEMQ_HTTP_ADDR"}} {
		_, stderr, err := idemq(t, append(env, tc.name+"="+addr), tc.cmd)
		if err == nil || !strings.Contains(stderr, tc.name+"="+addr) || !strings.Contains(stderr, "address already in use") {
			t.Errorf("idemq %s on a port in use: %v, stderr %q; want it to name %s=%s", tc.cmd, err, stderr, tc.name, addr)
		}
	}
}

// A row that is not in progress holds no lease: `ledger show` and `ledger list` say "-",
// the JSON says null, though a leased run's completion leaves locked_until set.
func TestLedgerShowsNoLeaseForFinishedRows(t *testing.T) {
	t.Parallel()
	dsn := testenv.PostgresURL(t)
	pool := testenv.Pool(t, dsn)
	testenv.Exec(t, pool, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, payload_sha256, result, attempts, locked_until, completed_at)
		VALUES ('debit:done', 'wallet:debit', 'completed', nextval('processed_jobs_fence_seq'), gen_random_uuid(), sha256('x'), '{"entry_id":1}', 1, now() + interval '20 seconds', now())`)
	env := []string{"DATABASE_URL=" + dsn}
	out, stderr, err := idemq(t, env, "ledger", "show", "debit:done")
	if err != nil || !regexp.MustCompile(`(?m)^lease until +-$`).MatchString(out) {
		t.Errorf("ledger show of a completed row: %v, want \"lease until  -\":\n%s%s", err, out, stderr)
	}
	out, stderr, err = idemq(t, env, "ledger", "list")
	if err != nil || !regexp.MustCompile(`(?m)^debit:done +wallet:debit +completed +\d+ +1 +- +\d{4}-`).MatchString(out) {
		t.Errorf("ledger list with a completed row: %v, want its lease column \"-\":\n%s%s", err, out, stderr)
	}
	out, stderr, err = idemq(t, env, "ledger", "show", "debit:done", "--json")
	if err != nil || !strings.Contains(out, `"locked_until":null`) {
		t.Errorf("ledger show --json of a completed row: %v, want \"locked_until\":null:\n%s%s", err, out, stderr)
	}
}

// Every subcommand's summary starts in one column of `idemq help`.
func TestHelpAlignsSummaries(t *testing.T) {
	t.Parallel()
	out, _, err := idemq(t, nil, "help")
	if err != nil {
		t.Fatal(err)
	}
	section := out[strings.Index(out, "Subcommands:\n")+len("Subcommands:\n"):]
	col := -1
	for _, c := range commands() {
		var line string
		for _, l := range strings.Split(section, "\n") {
			if strings.HasPrefix(l, "  "+c.name+" ") {
				line = l
				break
			}
		}
		at := strings.Index(line, c.summary)
		if line == "" || at < 0 {
			t.Fatalf("idemq help has no row for %s:\n%s", c.name, out)
		}
		if col == -1 {
			col = at
		}
		if at != col || line[at-1] != ' ' || line[at-2] != ' ' {
			t.Errorf("%s's summary starts at column %d, want %d after at least two spaces:\n%s", c.name, at, col, line)
		}
	}
}
