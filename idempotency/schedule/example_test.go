package schedule_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/idempotency/schedule"
	"github.com/idemq/idemq/internal/testenv"
)

// Example reads a schedule file, checks it against the task types this process enqueues,
// writes it to the schedule table (Run does it at its start, then ticks until its context
// ends), runs an entry by hand and lists the table.
func Example() {
	pool, closePostgres := testenv.ExamplePostgres(true) // idemq's migrations applied
	defer closePostgres()
	rdb, closeRedis := testenv.ExampleRedis()
	defer closeRedis()
	ctx := context.Background()
	client := outbox.NewClient(pool, rdb, nil)
	cfg := &schedule.Config{
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		// The task types this process's workers serve, each with its payload check.
		TaskTypes: map[string]func([]byte) error{"wallet:settle": nil},
	}

	typo, _ := schedule.ParseFile([]byte(`entries:
  - name: settle-hourly
    schedule: "0 * * * *"
    task_type: wallet:setle
`))
	_, err := schedule.New(pool, client, typo, cfg)
	fmt.Println(err)

	entries, err := schedule.ParseFile([]byte(`entries:
  - name: settle-hourly
    schedule: "0 * * * *"      # UTC: no time_zone
    task_type: wallet:settle
    payload: {period: 1h}
    max_retry: 5
`))
	if err != nil {
		fmt.Println(err)
		return
	}
	s, err := schedule.New(pool, client, entries, cfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := s.Sync(ctx); err != nil { // s.Run(ctx) syncs, then ticks
		fmt.Println(err)
		return
	}
	res, err := schedule.RunNow(ctx, pool, client, "settle-hourly", "backfill-1", time.Now())
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("manual run:", res.Key)

	list, err := schedule.List(ctx, pool, time.Date(2026, 12, 6, 7, 30, 0, 0, time.UTC))
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, e := range list {
		fmt.Printf("%s %q rev %d next %s\n", e.Name, e.Schedule, e.Revision, e.Next.Format(schedule.TickLayout))
	}
	// Output:
	// schedule: entry "settle-hourly": task_type: "wallet:setle" is not a task type this scheduler enqueues (wallet:settle)
	// manual run: cron:settle-hourly:manual:backfill-1
	// settle-hourly "0 * * * *" rev 1 next 2026-12-06T08:00:00Z
}
