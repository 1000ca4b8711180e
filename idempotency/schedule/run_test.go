package schedule_test

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/idempotency/schedule"
	"github.com/idemq/idemq/internal/testenv"
)

// countWarnings counts the records at warn level and above.
type countWarnings struct{ n *atomic.Int64 }

func (h countWarnings) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }
func (h countWarnings) Handle(context.Context, slog.Record) error    { h.n.Add(1); return nil }
func (h countWarnings) WithAttrs([]slog.Attr) slog.Handler           { return h }
func (h countWarnings) WithGroup(string) slog.Handler                { return h }

// TestRunBacksOffWhilePostgresIsGone: a scheduler whose Postgres stops retries its
// rounds with a growing wait (at most 5 s), not every 10 ms with a log line each time.
func TestRunBacksOffWhilePostgresIsGone(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	ctx := testenv.Context(t, 2*time.Minute)
	if err := testenv.Migrate(ctx, pg.URL); err != nil {
		t.Fatal(err)
	}
	pool := testenv.Pool(t, pg.URL)
	var warnings atomic.Int64
	s, err := schedule.New(pool, outbox.NewClient(pool, testenv.Redis(t), nil),
		[]schedule.Entry{{Name: "fast", Schedule: "@every 1s", TaskType: "t", CatchUp: schedule.CatchUpNone}},
		&schedule.Config{Logger: slog.New(countWarnings{&warnings})})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- s.Run(runCtx) }()
	defer func() { cancel(); <-done }()
	for testenv.Count(t, pool, `SELECT count(*) FROM job_intents`) < 2 {
		time.Sleep(200 * time.Millisecond)
	}
	if err := pg.Kill(); err != nil {
		t.Fatal(err)
	}
	const window = 5 * time.Second
	start := warnings.Load()
	time.Sleep(window) // the span over which the warnings are counted
	// Backing off from 100 ms, doubling to 5 s: at most 6 rounds in 5 s. Without a backoff
	// the loop ran every 10 ms.
	if n := warnings.Load() - start; n > 12 {
		t.Errorf("%d warnings in %v without Postgres, want at most 12 (a backoff)", n, window)
	}
}
