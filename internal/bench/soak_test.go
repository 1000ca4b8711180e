package bench

import (
	"context"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// steadyMinutes returns n minutes of a healthy soak: 600 completions a minute, p99 40 ms,
// processed_jobs growing for the first 5 minutes and then level, no slow purge, no lock
// wait behind it.
func steadyMinutes(n int) []SoakMinute {
	rows := make([]SoakMinute, n)
	for i := range rows {
		jobs := int64(min(i+1, 5)) << 20
		rows[i] = SoakMinute{Minute: i + 1, Completed: 600, P99ms: 40, PurgeMaxMS: 120, LockSamples: 30, HotLockWaits: 2,
			Tables: []SoakTable{{Name: "processed_jobs", TotalBytes: jobs}, {Name: "processed_job_events", TotalBytes: 64 << 10},
				{Name: "job_intents", TotalBytes: 16 << 10}}}
	}
	return rows
}

func results(vs []SoakVerdict) map[string]string {
	out := map[string]string{}
	for _, v := range vs {
		switch {
		case strings.HasPrefix(v.Target, "throughput"):
			out["throughput"] = v.Result
		case strings.HasPrefix(v.Target, "p99"):
			out["p99"] = v.Result
		case strings.HasPrefix(v.Target, "purge"):
			out["purge"] = v.Result
		case strings.HasPrefix(v.Target, "lock waits"):
			out["locks"] = v.Result
		case strings.HasPrefix(v.Target, "exactly once"):
			out["once"] = v.Result
		case strings.HasPrefix(v.Target, "steady"):
			out["steady"] = v.Result
		default:
			out[strings.Fields(v.Target)[0]] = v.Result
		}
	}
	return out
}

// Each target fails on its own symptom and on nothing else: the windows are the minutes
// after the warm-up and the last ones, the sizes compared with the end of the warm-up.
func TestSoakTargets(t *testing.T) {
	all := func(r string) map[string]string {
		m := map[string]string{}
		for _, k := range []string{"throughput", "p99", "processed_jobs", "processed_job_events", "job_intents", "purge", "locks", "once", "steady"} {
			m[k] = r
		}
		return m
	}
	with := func(m map[string]string, kv ...string) map[string]string {
		m = maps.Clone(m)
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	pass := all("PASS")
	for _, tc := range []struct {
		name    string
		n       int
		change  func(rows []SoakMinute)
		doubled int
		want    map[string]string
	}{
		{"steady", 35, func([]SoakMinute) {}, 0, pass},
		// Slow minutes inside the warm-up count for nothing.
		{"slow warm-up", 35, func(r []SoakMinute) { r[0].Completed, r[4].P99ms = 100, 900 }, 0, pass},
		{"throughput falls 6%", 35, func(r []SoakMinute) {
			for i := 30; i < 35; i++ {
				r[i].Completed = 564
			}
		}, 0, with(pass, "throughput", "FAIL")},
		{"throughput falls 4%", 35, func(r []SoakMinute) {
			for i := 30; i < 35; i++ {
				r[i].Completed = 576
			}
		}, 0, pass},
		{"one slow minute at the end", 35, func(r []SoakMinute) { r[33].P99ms = 61 }, 0, with(pass, "p99", "FAIL")},
		{"a slower minute after the warm-up lifts the bar", 35, func(r []SoakMinute) { r[6].P99ms, r[33].P99ms = 50, 61 }, 0, pass},
		{"ledger grows", 35, func(r []SoakMinute) { r[34].Tables[0].TotalBytes = 7 << 20 }, 0, with(pass, "processed_jobs", "FAIL")},
		{"ledger at 1.2×", 35, func(r []SoakMinute) { r[34].Tables[0].TotalBytes = 6 << 20 }, 0, pass},
		// Small tables pass under a MiB whatever their ratio; past it, the ratio counts.
		{"history doubles under a MiB", 35, func(r []SoakMinute) { r[34].Tables[1].TotalBytes = 128 << 10 }, 0, pass},
		{"history grows past a MiB", 35, func(r []SoakMinute) { r[34].Tables[1].TotalBytes = 2 << 20 }, 0, with(pass, "processed_job_events", "FAIL")},
		{"slow purge statement", 35, func(r []SoakMinute) { r[20].PurgeMaxMS = 1200 }, 0, with(pass, "purge", "FAIL")},
		{"slow purge batch, statements unread", 35, func(r []SoakMinute) {
			for i := range r {
				r[i].PurgeMaxMS = -1
			}
			r[12].PurgeOver1s = 1
		}, 0, with(pass, "purge", "FAIL")},
		{"hot path behind the purge", 35, func(r []SoakMinute) { r[12].HotWaitsOnPurge = 1 }, 0, with(pass, "locks", "FAIL")},
		{"doubled debit", 35, func([]SoakMinute) {}, 1, with(pass, "once", "FAIL")},
		// The rate is 10/s: a backlog of 100 is 10 s of it.
		{"backlog of 10 s", 35, func(r []SoakMinute) { r[34].Backlog = 100 }, 0, pass},
		{"backlog grows", 35, func(r []SoakMinute) { r[34].Backlog = 101 }, 0, with(pass, "steady", "FAIL")},
		{"not ended", 35, func([]SoakMinute) {}, -1, with(pass, "once", "SKIP")},
		// A smoke run: 1 minute of warm-up, then one minute against one.
		{"smoke", 3, func(r []SoakMinute) { r[2].Completed = 500 }, 0, with(pass, "throughput", "FAIL", "processed_jobs", "FAIL")},
		{"too short", 5, func([]SoakMinute) {}, 0, with(pass, "throughput", "SKIP", "p99", "SKIP",
			"processed_jobs", "SKIP", "processed_job_events", "SKIP", "job_intents", "SKIP")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rows := steadyMinutes(tc.n)
			tc.change(rows)
			warmup := 5
			if tc.n < 5 {
				warmup = 1
			}
			r := &SoakReport{Minutes: rows, WarmupMinutes: warmup, Doubled: tc.doubled, Rate: 10}
			if got := results(evaluateSoak(r)); !maps.Equal(got, tc.want) {
				t.Errorf("got %v, want %v", got, tc.want)
			}
		})
	}
}

// The pacer hands each slot out once, due at start + i/rate, whoever takes it.
func TestPacerSlots(t *testing.T) {
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	p := &pacer{start: start, rate: 400}
	for _, tc := range []struct {
		i    int64
		want time.Duration
	}{{0, 0}, {1, 2500 * time.Microsecond}, {400, time.Second}, {24000, time.Minute}} {
		if got := p.due(tc.i).Sub(start); got != tc.want {
			t.Errorf("slot %d due at +%s, want +%s", tc.i, got, tc.want)
		}
	}
	for _, tc := range []struct {
		d    time.Duration
		want int64
	}{{0, 0}, {time.Millisecond, 1}, {2500 * time.Microsecond, 1}, {time.Second, 400}, {time.Minute, 24000}} {
		if got := p.before(tc.d); got != tc.want {
			t.Errorf("%d slots before +%s, want %d", got, tc.d, tc.want)
		}
	}
	var mu sync.Mutex
	var got []int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 500 {
				i, due := p.take()
				if due != p.due(i) {
					t.Errorf("slot %d due %s, want %s", i, due, p.due(i))
				}
				mu.Lock()
				got = append(got, i)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	slices.Sort(got)
	for i, v := range got {
		if v != int64(i) {
			t.Fatalf("slots taken: %d at %d, want each of 0..3999 once", v, i)
		}
	}
}

// The worker's task bounds fit the retention: the busy budget of two leases, the most
// retries whose horizon still fits, and a refusal when not even one does.
func TestSoakTaskBounds(t *testing.T) {
	for _, tc := range []struct {
		retention, lease time.Duration
		retries          int
		busy             time.Duration
		fails            bool
	}{
		{time.Minute, 0, 0, 0, true}, // 1 s + 44 s + 1 m
		{105 * time.Second, 0, 1, time.Minute, false},
		{5 * time.Minute, 0, 3, time.Minute, false}, // 1 s + 44 + 74 + 118 s + 1 m = 4m57s
		{296 * time.Second, 0, 2, time.Minute, false},
		{720 * time.Hour, 0, 10, time.Minute, false},
		{time.Minute, 7 * time.Second, 1, 14 * time.Second, false}, // a smoke run: 1 s + 44 s + 14 s
		{time.Minute, 8 * time.Second, 0, 0, true},
	} {
		retries, busy, err := soakTaskBounds(tc.retention, tc.lease)
		if (err != nil) != tc.fails || retries != tc.retries || busy != tc.busy {
			t.Errorf("%s, lease %s: %d retries, busy %s, err %v; want %d retries, busy %s, failing %t",
				tc.retention, tc.lease, retries, busy, err, tc.retries, tc.busy, tc.fails)
		}
	}
}

// A minute's purge figures come from the difference of two scrapes of the worker's
// histogram and counters.
func TestSoakReadsPurgeMetrics(t *testing.T) {
	page := func(rows, fast, slow, count string) string {
		return `# TYPE idemq_purge_rows_total counter
idemq_purge_rows_total{table="processed_jobs"} ` + rows + `
idemq_purge_rows_total{table="job_intents"} 3
# TYPE idemq_purge_seconds histogram
idemq_purge_seconds_bucket{le="0.05"} ` + fast + `
idemq_purge_seconds_bucket{le="1"} ` + slow + `
idemq_purge_seconds_bucket{le="10"} ` + count + `
idemq_purge_seconds_bucket{le="+Inf"} ` + count + `
idemq_purge_seconds_sum 1
idemq_purge_seconds_count ` + count + `
`
	}
	var body string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, body) }))
	defer srv.Close()
	read := func(p string) (map[string]float64, purgeHistogram) {
		body = p
		m := scrape(context.Background(), srv.URL)
		return labelled(m, "idemq_purge_rows_total", "table"), readPurgeHistogram(m)
	}
	rows0, h0 := read(page("1000", "2", "2", "2"))
	if rows0["processed_jobs"] != 1000 || rows0["job_intents"] != 3 {
		t.Errorf("rows %v", rows0)
	}
	_, h1 := read(page("5000", "6", "7", "8"))
	if n, over, le := h1.since(h0); n != 6 || over != 1 || le != 10 {
		t.Errorf("6 batches, 1 over 1 s, slowest ≤ 10 s: got %d, %d, %g", n, over, le)
	}
	_, h2 := read(page("5000", "7", "8", "9"))
	if n, over, le := h2.since(h1); n != 1 || over != 0 || le != 0.05 {
		t.Errorf("1 batch ≤ 0.05 s: got %d, %d over 1 s, slowest ≤ %g", n, over, le)
	}
	if n, _, le := h2.since(h2); n != 0 || le != 0 {
		t.Errorf("no batch: got %d, slowest ≤ %g", n, le)
	}
}
