package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency/schedule"
	"github.com/idemq/idemq/internal/testenv"
)

// Two `idemq scheduler` replicas run one schedule file beside a worker; one is killed
// mid-run. Every tick from the first to the last is one wallet:settle job and one
// settlement row, the replicas found each other's ticks already enqueued, and `idemq
// schedule` lists, pauses and runs the entry.
func TestSchedulerReplicasSettleEachTickOnce(t *testing.T) {
	t.Parallel()
	s := startStack(t, 1, nil, nil)
	ctx := testenv.Context(t, 2*time.Minute)
	file := filepath.Join(t.TempDir(), "schedule.yaml")
	if err := os.WriteFile(file, []byte(`entries:
  - name: settle-2s
    schedule: "@every 2s"
    task_type: wallet:settle
    payload: {period: 2s}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	env := []string{"DATABASE_URL=" + s.dsn, "REDIS_URL=" + s.redisURL, "IDEMQ_SCHEDULE_FILE=" + file}
	var scheds []*proc
	var metricsURLs []string
	for i := range 2 {
		port := testenv.FreePort(t)
		url := fmt.Sprintf("http://127.0.0.1:%d", port)
		scheds = append(scheds, startIdemq(t, fmt.Sprintf("scheduler%d", i), append([]string{fmt.Sprintf("IDEMQ_METRICS_ADDR=127.0.0.1:%d", port)}, env...), "scheduler"))
		testenv.WaitHTTP(t, url+"/readyz", 30*time.Second)
		metricsURLs = append(metricsURLs, url+"/metrics")
	}
	time.Sleep(9 * time.Second)
	var enqueued, duplicate float64
	for _, u := range metricsURLs {
		enqueued += metricSum(t, u, "idemq_schedule_ticks_total", `event="enqueued"`)
		duplicate += metricSum(t, u, "idemq_schedule_ticks_total", `event="duplicate"`)
	}
	if enqueued < 3 || duplicate < 1 {
		t.Errorf("after 9 s of @every 2s on two replicas: %v enqueued, %v duplicate; want at least 3 and 1", enqueued, duplicate)
	}
	scheds[0].signal(syscall.SIGKILL)
	<-scheds[0].done

	out, stderr, err := idemq(t, env, "schedule", "list")
	if err != nil || !strings.Contains(out, "settle-2s") || !strings.Contains(out, "@every 2s") || !strings.Contains(out, "wallet:settle") {
		t.Errorf("schedule list: %v\n%s%s", err, out, stderr)
	}
	for range 2 {
		if out, stderr, err := idemq(t, env, "schedule", "run", "settle-2s", "--id", "by-hand"); err != nil {
			t.Fatalf("schedule run: %v\n%s%s", err, out, stderr)
		}
	}
	time.Sleep(4 * time.Second)
	if out, stderr, err := idemq(t, env, "schedule", "pause", "settle-2s"); err != nil {
		t.Fatalf("schedule pause: %v\n%s%s", err, out, stderr)
	}
	time.Sleep(3 * time.Second) // the surviving replica's round sees the pause
	var paused int
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM job_intents WHERE idempotency_key LIKE 'cron:settle-2s:%'`).Scan(&paused); err != nil {
		t.Fatal(err)
	}
	time.Sleep(4 * time.Second)
	var ticks []time.Time
	rows, err := s.pool.Query(ctx, `SELECT idempotency_key FROM job_intents WHERE idempotency_key LIKE 'cron:settle-2s:2%' ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			t.Fatal(err)
		}
		tick, err := time.Parse(schedule.TickLayout, strings.TrimPrefix(k, "cron:settle-2s:"))
		if err != nil {
			t.Fatalf("a tick's key %q: %v", k, err)
		}
		ticks = append(ticks, tick)
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	if len(ticks) < 6 {
		t.Fatalf("%d ticks enqueued in ~16 s of @every 2s, want at least 6", len(ticks))
	}
	for i := 1; i < len(ticks); i++ {
		if d := ticks[i].Sub(ticks[i-1]); d != 2*time.Second {
			t.Errorf("ticks %s then %s: a gap of %v", ticks[i-1].Format(schedule.TickLayout), ticks[i].Format(schedule.TickLayout), d)
		}
	}
	var after int
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM job_intents WHERE idempotency_key LIKE 'cron:settle-2s:%'`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if after != paused {
		t.Errorf("%d ticks enqueued while the entry was paused", after-paused)
	}

	// Every job settles once: one row per key, the manual run's included.
	s.waitCompleted(t, len(ticks)+1, 60*time.Second)
	var keys, rowsN, dupKeys int
	if err := s.pool.QueryRow(ctx, `SELECT count(DISTINCT settlement_key), count(*),
		count(*) FILTER (WHERE settlement_key = 'cron:settle-2s:manual:by-hand') FROM wallet_settlements`).Scan(&keys, &rowsN, &dupKeys); err != nil {
		t.Fatal(err)
	}
	if keys != len(ticks)+1 || rowsN != keys || dupKeys != 1 {
		t.Errorf("settlements: %d keys, %d rows, %d of the manual run; want %d keys, one row each, the manual run once", keys, rowsN, dupKeys, len(ticks)+1)
	}
	t.Logf("%d ticks, %v enqueued and %v found enqueued by the other replica in the first 9 s", len(ticks), enqueued, duplicate)
}
