package idempotency_test

import (
	"errors"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

func TestFindAndCount(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	l := idempotency.New(pool, nil)
	defer l.Close()
	ctx := testenv.Context(t, 20*time.Second)

	for _, f := range []idempotency.Filter{
		{Status: "done", Limit: 1}, {Lease: "dead", Limit: 1}, {Limit: 0}, {StartedWithin: -time.Second, Limit: 1},
	} {
		if _, err := l.Find(ctx, f); !errors.Is(err, idempotency.ErrInvalidRequest) {
			t.Errorf("Find(%+v) = %v, want ErrInvalidRequest", f, err)
		}
	}
	if _, err := l.Count(ctx, 0); !errors.Is(err, idempotency.ErrInvalidRequest) {
		t.Errorf("Count(0) = %v, want ErrInvalidRequest", err)
	}

	_, err := pool.Exec(ctx, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, started_at, locked_until)
		VALUES ('k:live', 't', 'in_progress', nextval('processed_jobs_fence_seq'), gen_random_uuid(), now(), now() + interval '1 hour'),
		       ('k:lapsed', 't', 'in_progress', nextval('processed_jobs_fence_seq'), gen_random_uuid(), now() - interval '2 hours', now() - interval '1 hour');
		INSERT INTO processed_job_events (idempotency_key, kind) VALUES ('k:lapsed', 'duplicate'), ('k:lapsed', 'duplicate')`)
	if err != nil {
		t.Fatal(err)
	}
	recs, err := l.Find(ctx, idempotency.Filter{Lease: idempotency.LeaseLapsed, HasDuplicates: true, Limit: 10})
	if err != nil || len(recs) != 1 || recs[0].Key != "k:lapsed" || recs[0].LeaseLive {
		t.Fatalf("Find lapsed with duplicates = %+v, %v; want k:lapsed", recs, err)
	}
	c, err := l.Count(ctx, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	// k:lapsed started before the window: only k:live counts; its events were recorded now.
	if c.Live != 1 || c.Lapsed != 0 || c.Completed != 0 || c.Events["duplicate"] != 2 {
		t.Fatalf("Count(1h) = %+v, want 1 live and 2 duplicates", c)
	}
	if c, _ = l.Count(ctx, 3*time.Hour); c.Live != 1 || c.Lapsed != 1 {
		t.Fatalf("Count(3h) = %+v, want 1 live and 1 lapsed", c)
	}
}
