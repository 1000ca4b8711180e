package main

import (
	"strings"
	"testing"
	"time"
)

func TestParseFaultPoints(t *testing.T) {
	fp, err := parseFaultPoints("after_claim:0.01, after_effect:0.02,debit_delay:1500ms,debit_error:0.2")
	if err != nil {
		t.Fatal(err)
	}
	want := faultPoints{afterClaim: 0.01, afterEffect: 0.02, debitError: 0.2, debitDelay: 1500 * time.Millisecond}
	if fp != want {
		t.Fatalf("parsed %+v, want %+v", fp, want)
	}
	if fp, err := parseFaultPoints(""); err != nil || fp != (faultPoints{}) {
		t.Fatalf("empty: %+v, %v; want nothing set", fp, err)
	}
	for spec, msg := range map[string]string{
		"debit_error:2":     "debit_error: want a probability between 0 and 1",
		"debit_delay:soon":  "debit_delay: want a duration",
		"after_kill:0.1":    `unknown fault point "after_kill"`,
		"after_claim:-0.01": "after_claim: want a probability",
	} {
		if _, err := parseFaultPoints(spec); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("%q: error %v, want one saying %q", spec, err, msg)
		}
	}
}
