package main

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency/schedule"
	"github.com/idemq/idemq/internal/testenv"
)

// A cron entry without time_zone is read in UTC on every host: two `idemq scheduler`
// replicas, one on a host in New York and one in Tokyo, name the same instant for
// "M H * * *" (H:M in UTC), and its tick is one job keyed by that instant.
func TestSchedulerReadsCronInUTCWhateverTheHostZone(t *testing.T) {
	t.Parallel()
	dsn := testenv.PostgresURL(t)
	pool := testenv.Pool(t, dsn)
	// The first whole UTC minute at least 25 s away: both replicas are up before it.
	tick := time.Now().UTC().Add(25 * time.Second).Truncate(time.Minute).Add(time.Minute)
	file := filepath.Join(t.TempDir(), "schedule.yaml")
	if err := os.WriteFile(file, []byte(fmt.Sprintf(`entries:
  - name: daily
    schedule: "%d %d * * *"
    task_type: wallet:settle
    payload: {period: 24h}
`, tick.Minute(), tick.Hour())), 0o600); err != nil {
		t.Fatal(err)
	}
	env := []string{"DATABASE_URL=" + dsn, "REDIS_URL=" + testenv.RedisURL(t), "IDEMQ_SCHEDULE_FILE=" + file}
	for _, zone := range []string{"America/New_York", "Asia/Tokyo"} {
		port := testenv.FreePort(t)
		startIdemq(t, "scheduler-"+filepath.Base(zone), append([]string{"TZ=" + zone, fmt.Sprintf("IDEMQ_METRICS_ADDR=127.0.0.1:%d", port)}, env...), "scheduler")
		testenv.WaitHTTP(t, fmt.Sprintf("http://127.0.0.1:%d/readyz", port), 30*time.Second)
	}
	want := schedule.TickKey("daily", tick)
	deadline := tick.Add(90 * time.Second)
	var keys []string
	for time.Now().Before(deadline) {
		keys = testenv.Strings(t, pool, `SELECT idempotency_key FROM job_intents WHERE idempotency_key LIKE 'cron:daily:%' ORDER BY 1`)
		if len(keys) > 0 && time.Now().After(tick.Add(15*time.Second)) {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	if len(keys) != 1 || keys[0] != want {
		t.Fatalf("jobs of %q after its tick: %q, want one, %s", fmt.Sprintf("%d %d * * *", tick.Minute(), tick.Hour()), keys, want)
	}
}
