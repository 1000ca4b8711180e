//go:build faults

package faults

import (
	"strings"
	"testing"
)

// TestCheckoutRule runs judgeCheckout on hand-made findings: what it must excuse (a
// receipt sent again by each earlier claim that did not record it) and what it must not.
func TestCheckoutRule(t *testing.T) {
	f := func(n int64) *int64 { return &n }
	const key, receipt = "checkout:co-3", "checkout:co-3#s/receipt"
	done := checkoutRow{key: key, orderID: "co-3", status: "completed", chargeID: "ch_1", orderRow: "41", emailID: "92"}
	steps := map[string]stepRow{"charge": {fence: 7}, "record": {fence: 7}, "receipt": {fence: 10}}
	order := []orderRow{{id: 41, fence: 7}}
	cases := []struct {
		name     string
		co       checkoutRow
		charges  []string
		orders   []orderRow
		emails   []emailRow
		steps    map[string]stepRow
		excused  int
		dups     [3]int // charges, order rows, emails
		problems string // a fragment of the first problem; empty: none
	}{
		{name: "once", co: done, charges: []string{"ch_1"}, orders: order, steps: steps,
			emails: []emailRow{{id: 92, fence: f(10), key: receipt}}},
		{name: "sent again by two claims that recorded nothing", co: done, charges: []string{"ch_1"}, orders: order, steps: steps,
			emails:  []emailRow{{id: 80, fence: f(8), key: receipt}, {id: 85, fence: f(9), key: receipt}, {id: 92, fence: f(10), key: receipt}},
			excused: 2},
		{name: "two emails of one earlier claim", co: done, charges: []string{"ch_1"}, orders: order, steps: steps,
			emails: []emailRow{{id: 80, fence: f(8), key: receipt}, {id: 81, fence: f(8), key: receipt}, {id: 92, fence: f(10), key: receipt}},
			dups:   [3]int{0, 0, 2}, problems: "emails under fences [8 8 10]"},
		{name: "an email after the recorded one", co: done, charges: []string{"ch_1"}, orders: order, steps: steps,
			emails: []emailRow{{id: 92, fence: f(10), key: receipt}, {id: 95, fence: f(11), key: receipt}},
			dups:   [3]int{0, 0, 1}, problems: "recorded under fence 10; 2 emails under fences [10 11]"},
		{name: "none under the recorded fence", co: done, charges: []string{"ch_1"}, orders: order, steps: steps,
			emails: []emailRow{{id: 80, fence: f(8), key: receipt}}, problems: "1 emails under fences [8]"},
		{name: "an email of another key", co: done, charges: []string{"ch_1"}, orders: order, steps: steps,
			emails: []emailRow{{id: 80, fence: f(8), key: "checkout:co-3"}, {id: 92, fence: f(10), key: receipt}},
			dups:   [3]int{0, 0, 1}, problems: `(key "checkout:co-3")`},
		{name: "result names the earlier email", co: checkoutRow{key: key, orderID: "co-3", status: "completed", chargeID: "ch_1", orderRow: "41", emailID: "80"},
			charges: []string{"ch_1"}, orders: order, steps: steps,
			emails:  []emailRow{{id: 80, fence: f(8), key: receipt}, {id: 92, fence: f(10), key: receipt}},
			excused: 1, problems: `names email "80"`},
		{name: "two order rows", co: done, charges: []string{"ch_1"}, orders: []orderRow{{id: 41, fence: 7}, {id: 44, fence: 8}}, steps: steps,
			emails: []emailRow{{id: 92, fence: f(10), key: receipt}}, dups: [3]int{0, 1, 0}, problems: "2 order rows, under fences [7 8]"},
		{name: "order row of another fence than its step", co: done, charges: []string{"ch_1"}, orders: []orderRow{{id: 41, fence: 8}}, steps: steps,
			emails: []emailRow{{id: 92, fence: f(10), key: receipt}}, problems: "fence 8, its record step fence 7"},
		{name: "two charges", co: done, charges: []string{"ch_1", "ch_2"}, orders: order, steps: steps,
			emails: []emailRow{{id: 92, fence: f(10), key: receipt}}, dups: [3]int{1, 0, 0}, problems: "2 charges under its step key"},
		{name: "completed without its receipt step", co: done, charges: []string{"ch_1"}, orders: order,
			steps: map[string]stepRow{"charge": {fence: 7}, "record": {fence: 7}}, emails: []emailRow{{id: 92, fence: f(10), key: receipt}},
			problems: `step "receipt" is not recorded`},
		{name: "not completed: two claims sent the receipt, neither recorded it",
			co: checkoutRow{key: key, orderID: "co-3", status: "in_progress"}, charges: []string{"ch_1"}, orders: order,
			steps:  map[string]stepRow{"charge": {fence: 7}, "record": {fence: 7}},
			emails: []emailRow{{id: 80, fence: f(8), key: receipt}, {id: 85, fence: f(9), key: receipt}}, excused: 1},
		{name: "not completed: one charge at most", co: checkoutRow{key: key, orderID: "co-3", status: "in_progress"},
			charges: []string{"ch_1", "ch_2"}, steps: map[string]stepRow{}, dups: [3]int{1, 0, 0}, problems: "2 charges"},
		{name: "no step records (control)", co: checkoutRow{key: key, orderID: "co-3"}, charges: []string{"ch_1", "ch_2"},
			orders: []orderRow{{id: 41}, {id: 44}}, emails: []emailRow{{id: 80, key: receipt}, {id: 85, key: receipt}},
			dups: [3]int{1, 1, 1}, problems: "2 charges"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cv := judgeCheckout(c.co, c.charges, len(c.charges), c.orders, c.emails, c.steps)
			if cv.excused != c.excused || [3]int{cv.dupCharges, cv.dupOrders, cv.dupEmail} != c.dups {
				t.Errorf("excused %d, duplicates %v; want %d, %v (problems %q)", cv.excused,
					[3]int{cv.dupCharges, cv.dupOrders, cv.dupEmail}, c.excused, c.dups, cv.problems)
			}
			switch {
			case c.problems == "" && len(cv.problems) > 0:
				t.Errorf("problems %q, want none", cv.problems)
			case c.problems != "" && (len(cv.problems) == 0 || !strings.Contains(cv.problems[0], c.problems)):
				t.Errorf("problems %q, want the first to say %q", cv.problems, c.problems)
			case c.problems != "" && !strings.HasPrefix(cv.problems[0], "checkout co-3: "):
				t.Errorf("problem %q does not name the order", cv.problems[0])
			}
		})
	}
	// A charge of the order under another key than its step key.
	if cv := judgeCheckout(done, []string{"ch_1"}, 2, order, []emailRow{{id: 92, fence: f(10), key: receipt}}, steps); len(cv.problems) != 1 ||
		!strings.Contains(cv.problems[0], "2 charges of the order, 1 of them under its step key") {
		t.Errorf("a charge under another key: problems %q", cv.problems)
	}
}
