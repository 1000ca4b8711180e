package main

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/config"
	"github.com/idemq/idemq/internal/testenv"
)

// binary is the idemq binary built once for the tests that run it as a process.
var binary string

func TestMain(m *testing.M) { testenv.RunWithIdemq(m, &binary) }

// idemq runs the binary with env added to a clean environment and returns its output.
func idemq(t *testing.T, env []string, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	var o, e strings.Builder
	cmd.Stdout, cmd.Stderr = &o, &e
	err = cmd.Run()
	return o.String(), e.String(), err
}

func envNames(t reflect.Type) []string {
	var names []string
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if f.Anonymous {
			names = append(names, envNames(f.Type)...)
			continue
		}
		names = append(names, f.Tag.Get("envconfig"))
	}
	return names
}

func TestHelpListsEveryVariable(t *testing.T) {
	t.Parallel()
	out, _, err := idemq(t, nil, "help")
	if err != nil {
		t.Fatal(err)
	}
	for _, spec := range []any{config.Migrate{}, config.Worker{}, config.Enqueue{}, config.Ledger{}, config.Fakepay{}, config.API{}} {
		for _, name := range envNames(reflect.TypeOf(spec)) {
			if !strings.Contains(out, name) {
				t.Errorf("idemq help does not mention %s", name)
			}
		}
	}
	// The traced subcommands name OpenTelemetry's variables and their service names.
	for _, c := range []string{"worker", "api", "fakepay"} {
		sub, _, err := idemq(t, nil, c, "-h")
		if err != nil || !strings.Contains(sub, "OTEL_EXPORTER_OTLP_ENDPOINT") || !strings.Contains(sub, "default idemq-"+c) {
			t.Errorf("idemq %s -h names no tracing variables (%v):\n%s", c, err, sub)
		}
	}
	sub, _, err := idemq(t, nil, "migrate", "-h")
	if err != nil || !strings.Contains(sub, "DATABASE_URL") {
		t.Fatalf("idemq migrate -h: %v\n%s", err, sub)
	}
}

// The benchmarks are a tool of their own (cmd/idemq-bench), not a subcommand.
func TestHelpListsNoBench(t *testing.T) {
	t.Parallel()
	out, _, err := idemq(t, nil, "help")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "  bench ") || strings.HasPrefix(line, "idemq bench") {
			t.Errorf("idemq help lists bench: %q", line)
		}
	}
	if _, stderr, err := idemq(t, nil, "bench"); err == nil || !strings.Contains(stderr, `unknown subcommand "bench"`) {
		t.Errorf("idemq bench: %v, stderr %q; want an unknown subcommand", err, stderr)
	}
}

func TestBadValueStopsWithOneLine(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ env, want string }{
		{"DATABASE_URL=http://nope", "DATABASE_URL: not a valid Postgres URL"},
		{"IDEMQ_FAKEPAY_DELAY=-1s", "IDEMQ_FAKEPAY_DELAY: negative duration"},
		{"IDEMQ_FAKEPAY_DELAY=soon", `IDEMQ_FAKEPAY_DELAY="soon": not a valid duration (such as`},
		{"IDEMQ_FAKEPAY_HONOR_KEYS=maybe", "IDEMQ_FAKEPAY_HONOR_KEYS"},
		{"IDEMQ_TRACE_URL_TEMPLATE=http://jaeger:16686/trace/", "IDEMQ_TRACE_URL_TEMPLATE: not an http(s) URL with {trace_id} in it"},
	} {
		_, stderr, err := idemq(t, []string{tc.env}, "fakepay")
		if strings.HasPrefix(tc.env, "IDEMQ_TRACE_URL_TEMPLATE") {
			_, stderr, err = idemq(t, []string{tc.env}, "api")
		}
		if err == nil {
			t.Fatalf("%s: exit 0, want a failure", tc.env)
		}
		lines := strings.Split(strings.TrimSpace(stderr), "\n")
		if len(lines) != 1 || !strings.Contains(lines[0], tc.want) {
			t.Errorf("%s: stderr %q, want one line containing %q", tc.env, stderr, tc.want)
		}
	}
}

func TestMigrateIsRepeatableAndConcurrent(t *testing.T) {
	t.Parallel()
	dsn := testenv.EmptyPostgresURL(t)
	env := []string{"DATABASE_URL=" + dsn}

	var wg sync.WaitGroup
	outs := make([]string, 2)
	errs := make([]error, 2)
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[i], _, errs[i] = idemq(t, env, "migrate")
		}()
	}
	wg.Wait()
	for i := range 2 {
		if errs[i] != nil {
			t.Fatalf("concurrent migrate %d: %v\n%s", i, errs[i], outs[i])
		}
	}
	if n := strings.Count(outs[0]+outs[1], "applied 00001_processed_jobs.sql"); n != 1 {
		t.Fatalf("00001 applied %d times across two concurrent runs, want 1:\n%s\n%s", n, outs[0], outs[1])
	}
	again, _, err := idemq(t, env, "migrate")
	if err != nil || !strings.Contains(again, "nothing to apply") {
		t.Fatalf("third migrate: %v\n%s", err, again)
	}

	// Each set's versions once in its own table, none in goose's default one; the
	// example's tables (which migrations.Up never creates) are there.
	pool := testenv.Pool(t, dsn)
	ctx := testenv.Context(t, 10*time.Second)
	for _, set := range []struct{ table, glob string }{
		{"idemq_db_version", "../../migrations/*.sql"},
		{"idemq_example_db_version", "../../migrations/example/*.sql"},
	} {
		var rows, versions int
		if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT version_id) FROM `+set.table+` WHERE version_id > 0`).Scan(&rows, &versions); err != nil {
			t.Fatal(err)
		}
		files, _ := filepath.Glob(set.glob)
		if len(files) == 0 || rows != len(files) || versions != len(files) {
			t.Fatalf("%s has %d rows, %d versions; want %d each", set.table, rows, versions, len(files))
		}
	}
	var gooseTable, fakepayRequests, fakepayCharges, walletEntries bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass('goose_db_version') IS NOT NULL, to_regclass('fakepay_requests') IS NOT NULL,
		to_regclass('fakepay_charges') IS NOT NULL, to_regclass('wallet_entries') IS NOT NULL`).Scan(&gooseTable, &fakepayRequests, &fakepayCharges, &walletEntries); err != nil {
		t.Fatal(err)
	}
	if gooseTable || !fakepayRequests || !fakepayCharges || !walletEntries {
		t.Fatalf("goose_db_version %v, fakepay_requests %v, fakepay_charges %v, wallet_entries %v; want only the example's tables",
			gooseTable, fakepayRequests, fakepayCharges, walletEntries)
	}
	core, _ := filepath.Glob("../../migrations/*.sql")
	example, _ := filepath.Glob("../../migrations/example/*.sql")
	status, _, err := idemq(t, env, "migrate", "status")
	if err != nil || strings.Count(status, "applied") != len(core)+len(example) || !strings.Contains(status, "example/00011_wallet_entries.sql") {
		t.Fatalf("migrate status: %v\n%s", err, status)
	}
}

func TestEnqueueAndLedgerCommands(t *testing.T) {
	t.Parallel()
	env := []string{"DATABASE_URL=" + testenv.PostgresURL(t), "REDIS_URL=" + testenv.RedisURL(t)}
	args := []string{"enqueue", "debit", "--account-id", "a-1", "--amount-cents", "250", "--reference", "cli-1"}
	out, stderr, err := idemq(t, env, args...)
	if err != nil || !strings.Contains(out, "debit:cli-1\taccepted (published)") {
		t.Fatalf("first enqueue: %v\n%s%s", err, out, stderr)
	}
	out, _, err = idemq(t, env, args...)
	if err != nil || !strings.Contains(out, "debit:cli-1\tduplicate") {
		t.Fatalf("second enqueue: %v\n%s", err, out)
	}
	_, stderr, err = idemq(t, env, "enqueue", "debit", "--account-id", "a-1", "--amount-cents", "999", "--reference", "cli-1")
	if err == nil || !strings.Contains(stderr, "another payload") {
		t.Fatalf("same reference, other amount: %v\n%s", err, stderr)
	}
	_, stderr, err = idemq(t, env, "enqueue", "charge", "--order-id", strings.Repeat("o", 300), "--customer-id", "c", "--amount-cents", "1")
	if err == nil || !strings.Contains(stderr, "the limit is 248") {
		t.Fatalf("oversized key: %v\n%s", err, stderr)
	}
	_, stderr, err = idemq(t, env, "ledger", "show", "debit:cli-1")
	if err == nil || !strings.Contains(stderr, `no ledger row for key "debit:cli-1"`) {
		t.Fatalf("ledger show of an unclaimed key: %v\n%s", err, stderr)
	}
	out, _, err = idemq(t, env, "ledger", "list", "--json")
	if err != nil || strings.TrimSpace(out) != "[]" {
		t.Fatalf("ledger list: %v\n%s", err, out)
	}
}

// TestEnqueueCheckout: `idemq enqueue checkout` records a checkout as `enqueue charge`
// records a charge: accepted, then a duplicate, another payload for the order refused; a
// bad --email is named, never quoted, and an order id too long for the step keys is named.
func TestEnqueueCheckout(t *testing.T) {
	t.Parallel()
	env := []string{"DATABASE_URL=" + testenv.PostgresURL(t), "REDIS_URL=" + testenv.RedisURL(t)}
	args := []string{"enqueue", "checkout", "--order-id", "cli-1", "--customer-id", "c-1", "--amount-cents", "1999", "--email", "ann@example.com"}
	out, stderr, err := idemq(t, env, args...)
	if err != nil || !strings.Contains(out, "checkout:cli-1\taccepted (published)") {
		t.Fatalf("first enqueue: %v\n%s%s", err, out, stderr)
	}
	out, _, err = idemq(t, env, append(args, "--currency", "eur")...)
	if err != nil || !strings.Contains(out, "checkout:cli-1\tduplicate") {
		t.Fatalf("second enqueue: %v\n%s", err, out)
	}
	_, stderr, err = idemq(t, env, "enqueue", "checkout", "--order-id", "cli-1", "--customer-id", "c-1", "--amount-cents", "1999", "--email", "bob@example.com")
	if err == nil || !strings.Contains(stderr, "another payload") {
		t.Fatalf("same order, other email: %v\n%s", err, stderr)
	}
	_, stderr, err = idemq(t, env, "enqueue", "checkout", "--order-id", "cli-2", "--customer-id", "c-1", "--amount-cents", "1", "--email", "secret.person.example.com")
	if err == nil || !strings.Contains(stderr, "--email: must be local@domain") || strings.Contains(stderr, "secret.person") {
		t.Fatalf("bad email: %v\n%s", err, stderr)
	}
	_, stderr, err = idemq(t, env, "enqueue", "checkout", "--order-id", strings.Repeat("o", 237), "--customer-id", "c", "--amount-cents", "1", "--email", "ann@example.com")
	if err == nil || !strings.Contains(stderr, "--order-id: 237 bytes; the limit is 236") {
		t.Fatalf("order id too long for the step keys: %v\n%s", err, stderr)
	}
}

func TestConfigurationPageListsEveryVariable(t *testing.T) {
	t.Parallel()
	page, err := os.ReadFile(configDocPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, spec := range []any{config.Migrate{}, config.Worker{}, config.API{}, config.Enqueue{}, config.Ledger{}, config.Fakepay{}} {
		for _, name := range envNames(reflect.TypeOf(spec)) {
			if !strings.Contains(string(page), "`"+name+"`") {
				t.Errorf("docs/configuration.md does not document %s", name)
			}
		}
	}
}

func TestCommandsRefuseBadInputNamingTheRule(t *testing.T) {
	t.Parallel()
	env := []string{"DATABASE_URL=" + testenv.PostgresURL(t), "REDIS_URL=" + testenv.RedisURL(t)}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"enqueue", "charge", "--customer-id", "c", "--amount-cents", "1"}, "--order-id: required"},
		{[]string{"enqueue", "debit", "--account-id", "a", "--amount-cents", "1"}, "--reference: required"},
		{[]string{"enqueue", "charge", "--order-id", "o", "--amount-cents", "1"}, "--customer-id: required"},
		{[]string{"enqueue", "charge", "--order-id", "o", "--customer-id", "c", "--amount-cents", "100000000000"}, "--amount-cents: must be a positive whole number of cents, at most 99999999999"},
		{[]string{"enqueue", "debit", "--account-id", "a", "--reference", "r", "--amount-cents", "9223372036854775807"}, "at most 99999999999"},
		{[]string{"enqueue", "checkout", "--order-id", "o", "--customer-id", "c", "--amount-cents", "1"}, "--email: must be 1 to 254 bytes, got 0"},
		{[]string{"enqueue", "checkout", "--customer-id", "c", "--amount-cents", "1", "--email", "a@b"}, "--order-id: required"},
		{[]string{"enqueue", "refund"}, `unknown task "refund" (charge, debit or checkout)`},
		{[]string{"ledger", "show", "\xff"}, `invalid key: byte 0xff at offset 0, must be printable ASCII`},
		{[]string{"ledger", "rerun", "has space"}, `invalid key: byte 0x20 at offset 3`},
		{[]string{"ledger", "release", ""}, `invalid key: empty`},
		{[]string{"ledger", "list", "--limit", "-1"}, "--limit: must be from 1 to 10000, got -1"},
		{[]string{"ledger", "list", "--limit", "0"}, "--limit: must be from 1 to 10000, got 0"},
		{[]string{"ledger", "list", "--limit", "99999999999"}, "--limit: must be from 1 to 10000, got 99999999999"},
		{[]string{"ledger", "list", "--status", "bogus"}, `--status: unknown status "bogus": want in_progress, completed, failed or needs_attention`},
	} {
		_, stderr, err := idemq(t, env, tc.args...)
		if err == nil || !strings.Contains(stderr, tc.want) {
			t.Errorf("idemq %q: %v, stderr %q; want a failure naming %q", tc.args, err, stderr, tc.want)
		}
		if strings.Contains(stderr, "SQLSTATE") || strings.Contains(stderr, "order_id") || strings.Contains(stderr, "amount_cents") {
			t.Errorf("idemq %q: stderr %q names a column or field instead of the flag or rule", tc.args, stderr)
		}
	}

	// Flags may follow the key, as the usage shows.
	pool := testenv.Pool(t, env[0][len("DATABASE_URL="):])
	testenv.Exec(t, pool, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, payload_sha256, result, completed_at)
		VALUES ('debit:flags-after', 'wallet:debit', 'completed', nextval('processed_jobs_fence_seq'), gen_random_uuid(), sha256('x'), '{"entry_id":1}', now())`)
	out, stderr, err := idemq(t, env, "ledger", "show", "debit:flags-after", "--json")
	if err != nil || !strings.Contains(out, `"key":"debit:flags-after"`) || !strings.Contains(out, `"status":"completed"`) {
		t.Fatalf("ledger show KEY --json: %v\n%s%s", err, out, stderr)
	}
	out, stderr, err = idemq(t, env, "ledger", "list", "--limit", "10000", "--json")
	if err != nil || !strings.Contains(out, `"key":"debit:flags-after"`) {
		t.Fatalf("ledger list --limit 10000 --json: %v\n%s%s", err, out, stderr)
	}
}

func TestLedgerShowListsSteps(t *testing.T) {
	t.Parallel()
	env := []string{"DATABASE_URL=" + testenv.PostgresURL(t), "REDIS_URL=" + testenv.RedisURL(t)}
	pool := testenv.Pool(t, env[0][len("DATABASE_URL="):])
	testenv.Exec(t, pool, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, payload_sha256, result, completed_at, generation)
		VALUES ('checkout:steps', 'order:checkout', 'completed', 41, gen_random_uuid(), sha256('x'), '{"order":1}', now(), 1),
		       ('checkout:none', 'order:checkout', 'completed', 42, gen_random_uuid(), sha256('x'), '{"order":2}', now(), 0)`)
	testenv.Exec(t, pool, `INSERT INTO processed_job_steps (idempotency_key, generation, step, seq, fence, result) VALUES
		('checkout:steps', 1, 'receipt', 1, 41, '"sent"'),
		('checkout:steps', 1, 'charge', 0, 40, '{"id":"ch_1"}'),
		('checkout:steps', 0, 'stale', 0, 39, '1')`)

	out, stderr, err := idemq(t, env, "ledger", "show", "checkout:steps")
	if err != nil {
		t.Fatalf("ledger show: %v\n%s", err, stderr)
	}
	var steps []string
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) >= 2 && (f[0] == "charge" || f[0] == "receipt" || f[0] == "stale") {
			steps = append(steps, f[0]+" "+f[1])
		}
	}
	if !strings.Contains(out, "STEP") || strings.Join(steps, ", ") != "charge 40, receipt 41" || !strings.Contains(out, `{"id": "ch_1"}`) {
		t.Errorf("ledger show: want the generation's steps charge (fence 40) then receipt (41), not the stale one:\n%s", out)
	}

	out, stderr, err = idemq(t, env, "ledger", "show", "checkout:steps", "--json")
	if err != nil {
		t.Fatalf("ledger show --json: %v\n%s", err, stderr)
	}
	var rec struct {
		Steps []struct {
			Name      string          `json:"name"`
			Fence     int64           `json:"fence"`
			Result    json.RawMessage `json:"result"`
			CreatedAt time.Time       `json:"created_at"`
		} `json:"steps"`
	}
	if err := json.Unmarshal([]byte(out), &rec); err != nil {
		t.Fatalf("ledger show --json: %v\n%s", err, out)
	}
	if len(rec.Steps) != 2 || rec.Steps[0].Name != "charge" || rec.Steps[0].Fence != 40 || string(rec.Steps[0].Result) != `{"id":"ch_1"}` ||
		rec.Steps[1].Name != "receipt" || rec.Steps[1].CreatedAt.IsZero() {
		t.Errorf("ledger show --json: steps %+v, want charge (fence 40) then receipt\n%s", rec.Steps, out)
	}

	for _, args := range [][]string{{"ledger", "show", "checkout:none"}, {"ledger", "show", "checkout:none", "--json"}} {
		out, stderr, err = idemq(t, env, args...)
		if err != nil || strings.Contains(out, "STEP") || strings.Contains(out, `"steps"`) {
			t.Errorf("idemq %q of a key without steps: %v\n%s%s", args, err, out, stderr)
		}
	}
}
