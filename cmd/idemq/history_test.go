package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/api"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/internal/testledger"
	"github.com/idemq/idemq/tasks"
)

// TestLedgerShowPrintsHistory takes a key through a crash and takeover, a duplicate, a
// mismatch and a rerun, and finds all four in `ledger show` and `ledger show --json`.
func TestLedgerShowPrintsHistory(t *testing.T) {
	t.Parallel()
	env := []string{"DATABASE_URL=" + testenv.PostgresURL(t), "REDIS_URL=" + testenv.RedisURL(t)}
	pool := testenv.Pool(t, env[0][len("DATABASE_URL="):])
	l := idempotency.New(pool, nil)
	defer l.Close()
	key := "charge:cli-story"
	oldFence, newFence := testledger.Story(t, l, key, tasks.TypeCharge)

	out, stderr, err := idemq(t, env, "ledger", "show", key)
	if err != nil {
		t.Fatalf("ledger show: %v\n%s", err, stderr)
	}
	_, table, ok := strings.Cut(out, "HISTORY")
	if !ok {
		t.Fatalf("ledger show prints no history:\n%s", out)
	}
	var kinds []string
	for _, line := range strings.Split(table, "\n") {
		f := strings.Fields(line)
		if len(f) < 8 || f[0] == "GEN" {
			continue
		}
		// at (date, time), generation, kind, fence, old fence, task id, worker, detail...
		kinds = append(kinds, f[3])
		switch f[3] {
		case "takeover":
			if f[4] != fmt.Sprint(newFence) || f[5] != fmt.Sprint(oldFence) || f[6] != key {
				t.Errorf("takeover line %q: want fence %d, old fence %d, task id %s", line, newFence, oldFence, key)
			}
		case "duplicate":
			if f[6] != key+"-again" {
				t.Errorf("duplicate line %q: want task id %s-again", line, key)
			}
		case "rerun":
			if f[2] != "1" {
				t.Errorf("rerun line %q: want generation 1", line)
			}
		}
	}
	if got := strings.Join(kinds, ","); got != "takeover,duplicate,mismatch,rerun" {
		t.Fatalf("ledger show history %s, want takeover,duplicate,mismatch,rerun:\n%s", got, out)
	}

	out, stderr, err = idemq(t, env, "ledger", "show", key, "--json")
	if err != nil {
		t.Fatalf("ledger show --json: %v\n%s", err, stderr)
	}
	var rec api.Record
	if err := json.Unmarshal([]byte(out), &rec); err != nil {
		t.Fatalf("ledger show --json: %v\n%s", err, out)
	}
	kinds = kinds[:0]
	for _, e := range rec.History {
		kinds = append(kinds, e.Kind)
		if e.Kind == "takeover" && (e.Fence != newFence || e.OldFence != oldFence || e.Worker == "") {
			t.Errorf("--json takeover %+v: want fence %d, old fence %d and a worker", e, newFence, oldFence)
		}
	}
	if got := strings.Join(kinds, ","); got != "takeover,duplicate,mismatch,rerun" {
		t.Fatalf("ledger show --json history %s, want takeover,duplicate,mismatch,rerun:\n%s", got, out)
	}
}
