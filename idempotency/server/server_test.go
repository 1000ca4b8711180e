package server_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/idempotency/schedule"
	"github.com/idemq/idemq/idempotency/server"
	"github.com/idemq/idemq/internal/testenv"
)

// transfer is a transactional job: a row in transfers, once per reference.
type transfer struct {
	Account string `json:"account"`
	Cents   int64  `json:"cents"`
	Ref     string `json:"ref"`
}

func (t transfer) Key() string       { return "transfer:" + t.Ref }
func (t transfer) LockScope() string { return "account:" + t.Account }

func (t transfer) Validate() error {
	if t.Cents <= 0 {
		return fmt.Errorf("cents: must be positive, got %d", t.Cents)
	}
	return nil
}

// notice is a leased job: an external call, counted.
type notice struct {
	Order string `json:"order"`
}

func (n notice) Key() string       { return "notice:" + n.Order }
func (n notice) LockScope() string { return "" }

const (
	typeTransfer = "test:transfer"
	typeNotice   = "test:notice"
)

// spec is the outbox spec of a job of typ with payload v.
func spec(t testing.TB, typ string, v idempotency.Job) outbox.Spec {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return outbox.Spec{Key: v.Key(), Type: typ, Payload: b, Queue: server.DefaultQueue, MaxRetry: 5,
		Timeout: 30 * time.Second, Retention: time.Hour}
}

// env is a test's own Postgres schema and Redis database, with a transfers table.
type env struct {
	pool *pgxpool.Pool
	rdb  *redis.Client
}

func newEnv(t *testing.T) env {
	t.Helper()
	e := env{pool: testenv.Postgres(t), rdb: testenv.Redis(t)}
	testenv.Exec(t, e.pool, `CREATE TABLE transfers (account text NOT NULL, cents bigint NOT NULL, ref text NOT NULL)`)
	return e
}

// handlers registers the two test jobs on s; calls counts the notices sent, by key.
func handlers(s *server.Server, calls *sync.Map, noticeTime time.Duration) {
	server.HandleTx(s, typeTransfer, func(ctx context.Context, tx pgx.Tx, j transfer) (json.RawMessage, error) {
		_, err := tx.Exec(ctx, `INSERT INTO transfers (account, cents, ref) VALUES ($1, $2, $3)`, j.Account, j.Cents, j.Ref)
		return json.RawMessage(`{"ok":true}`), err
	})
	server.HandleLeased(s, typeNotice, func(ctx context.Context, j notice) (json.RawMessage, error) {
		key, _, _ := idempotency.FromContext(ctx)
		n, _ := calls.LoadOrStore(key, new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
		time.Sleep(noticeTime)
		return json.RawMessage(`{"sent":true}`), nil
	})
}

// run starts s.Run and returns what stops it and waits for its result.
func run(t *testing.T, s *server.Server) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return func() error {
		cancel()
		select {
		case err := <-done:
			done <- err
			return err
		case <-time.After(30 * time.Second):
			t.Fatal("Run did not return 30s after its context ended")
			return nil
		}
	}
}

// waitCompleted waits until key's ledger row is completed.
func waitCompleted(t *testing.T, s *server.Server, key string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		r, err := s.Ledger().Get(context.Background(), key)
		if err == nil && r.Status == idempotency.StatusCompleted {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not completed after %v: %+v, %v", key, within, r, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitIdle waits until the default queue has nothing left to run.
func waitIdle(t *testing.T, rdb *redis.Client, within time.Duration) {
	t.Helper()
	insp := asynq.NewInspectorFromRedisClient(rdb)
	deadline := time.Now().Add(within)
	for {
		q, err := insp.GetQueueInfo(server.DefaultQueue)
		if err == nil && q.Pending+q.Active+q.Scheduled+q.Retry == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("queue not idle after %v: %+v, %v", within, q, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestRunRunsEachJobOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := testenv.Context(t, 2*time.Minute)
	s, err := server.New(server.Config{Postgres: e.pool, Redis: e.rdb, Concurrency: 8, ShutdownTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var calls sync.Map
	handlers(s, &calls, 200*time.Millisecond)
	stop := run(t, s)

	// Each job accepted twice through the outbox (one intent) and published three more
	// times under TaskIDs of its own, as a plain asynq producer's duplicates are.
	client := asynq.NewClientFromRedisClient(e.rdb)
	defer client.Close()
	jobs := []outbox.Spec{
		spec(t, typeTransfer, transfer{Account: "a-1", Cents: 250, Ref: "r-1"}),
		spec(t, typeTransfer, transfer{Account: "a-1", Cents: 100, Ref: "r-2"}),
		spec(t, typeNotice, notice{Order: "o-1"}),
		spec(t, typeNotice, notice{Order: "o-2"}),
	}
	for _, j := range jobs {
		for i := range 2 {
			res, err := s.Outbox().Enqueue(ctx, j)
			if err != nil || res.Duplicate != (i == 1) {
				t.Fatalf("Enqueue(%s) #%d = %+v, %v", j.Key, i+1, res, err)
			}
		}
		for i := range 3 {
			if _, err := client.EnqueueContext(ctx, j.Task(fmt.Sprintf("%s-dup-%d", j.Key, i), time.Now())); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, j := range jobs {
		waitCompleted(t, s, j.Key, 30*time.Second)
	}
	waitIdle(t, e.rdb, 30*time.Second)

	for _, ref := range []string{"r-1", "r-2"} {
		if n := testenv.Count(t, e.pool, `SELECT count(*) FROM transfers WHERE ref = $1`, ref); n != 1 {
			t.Errorf("transfer %s written %d times, want once", ref, n)
		}
	}
	for _, key := range []string{"notice:o-1", "notice:o-2"} {
		n, _ := calls.Load(key)
		if n == nil || n.(*atomic.Int64).Load() != 1 {
			t.Errorf("%s sent %v times, want once", key, n)
		}
	}
	if err := stop(); err != nil {
		t.Fatalf("Run = %v after its context ended, want nil", err)
	}
}

// A payload the job's Validate refuses, and a task type nobody registered, are archived at
// once with the reason, with no ledger row.
func TestRunArchivesWhatItCannotRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := testenv.Context(t, time.Minute)
	s, err := server.New(server.Config{Postgres: e.pool, Redis: e.rdb, ShutdownTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	handlers(s, new(sync.Map), 0)
	run(t, s)
	client := asynq.NewClientFromRedisClient(e.rdb)
	defer client.Close()
	for _, task := range []*asynq.Task{
		asynq.NewTask(typeTransfer, []byte(`{"account":"a","cents":0,"ref":"r-0"}`), asynq.TaskID("zero")),
		asynq.NewTask(typeTransfer, []byte(`{"account":"a","cents":5,"ref":"r-5","Ref":"r-6"}`), asynq.TaskID("variant")),
		asynq.NewTask("test:unknown", []byte(`{}`), asynq.TaskID("unknown")),
	} {
		if _, err := client.EnqueueContext(ctx, task); err != nil {
			t.Fatal(err)
		}
	}
	want := map[string]string{
		"zero":    "cents: must be positive, got 0",
		"variant": `Ref: field names are case-sensitive (did you mean "ref"?)`,
		"unknown": `unknown task type "test:unknown" on queue "default": this worker handles test:transfer, test:notice and archives`,
	}
	insp := asynq.NewInspectorFromRedisClient(e.rdb)
	deadline := time.Now().Add(30 * time.Second)
	for {
		archived, _ := insp.ListArchivedTasks(server.DefaultQueue)
		if len(archived) == len(want) {
			for _, a := range archived {
				if !strings.Contains(a.LastErr, want[a.ID]) || a.Retried != 0 {
					t.Errorf("task %s archived after %d retries with %q, want at once with %q", a.ID, a.Retried, a.LastErr, want[a.ID])
				}
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("archived %d tasks, want %d", len(archived), len(want))
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, key := range []string{"transfer:r-0", "transfer:r-5"} {
		if _, err := s.Ledger().Get(ctx, key); !errors.Is(err, idempotency.ErrNotFound) {
			t.Errorf("ledger row of %s: %v, want none", key, err)
		}
	}
}

// When its context ends, Run lets the running deliveries finish (within ShutdownTimeout)
// and returns once they are recorded.
func TestRunDrainsWhenItsContextEnds(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := testenv.Context(t, time.Minute)
	s, err := server.New(server.Config{Postgres: e.pool, Redis: e.rdb, ShutdownTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{})
	var once sync.Once
	server.HandleLeased(s, typeNotice, func(ctx context.Context, j notice) (json.RawMessage, error) {
		once.Do(func() { close(started) })
		time.Sleep(time.Second)
		return json.RawMessage(`{"sent":true}`), ctx.Err()
	})
	stop := run(t, s)
	if _, err := s.Outbox().Enqueue(ctx, spec(t, typeNotice, notice{Order: "slow"})); err != nil {
		t.Fatal(err)
	}
	select {
	case <-started:
	case <-ctx.Done():
		t.Fatal("the job never started")
	}
	begin := time.Now()
	if err := stop(); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	r, err := s.Ledger().Get(ctx, "notice:slow")
	if err != nil || r.Status != idempotency.StatusCompleted {
		t.Fatalf("after the drain (%v) the running job's row is %+v, %v; want completed", time.Since(begin), r, err)
	}
}

// The reconciler runs by default: an accepted job whose task Redis lost (here, before the
// worker started) is published again and runs.
func TestRunRepublishesWhatRedisLost(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := testenv.Context(t, time.Minute)
	s, err := server.New(server.Config{Postgres: e.pool, Redis: e.rdb, ShutdownTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	handlers(s, new(sync.Map), 0)
	j := spec(t, typeTransfer, transfer{Account: "a-1", Cents: 7, Ref: "lost"})
	res, err := s.Outbox().Enqueue(ctx, j)
	if err != nil || res.State != outbox.IntentPublished {
		t.Fatalf("Enqueue = %+v, %v; want it published", res, err)
	}
	if err := e.rdb.FlushDB(ctx).Err(); err != nil { // the test's own database
		t.Fatal(err)
	}
	run(t, s)
	waitCompleted(t, s, j.Key, 30*time.Second)
	if n := testenv.Count(t, e.pool, `SELECT count(*) FROM transfers WHERE ref = 'lost'`); n != 1 {
		t.Fatalf("transfer written %d times, want once", n)
	}
}

func TestNewRefusesInvalidConfig(t *testing.T) {
	t.Parallel()
	pool, rdb := new(pgxpool.Pool), redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer rdb.Close()
	for _, tc := range []struct {
		name    string
		cfg     server.Config
		wantErr string
	}{
		{"no Postgres", server.Config{Redis: rdb}, "Config.Postgres is required"},
		{"no Redis", server.Config{Postgres: pool}, "Config.Redis is required"},
		{"negative concurrency", server.Config{Postgres: pool, Redis: rdb, Concurrency: -1}, "Config.Concurrency is -1"},
		{"negative lease", server.Config{Postgres: pool, Redis: rdb, Lease: -time.Second}, "Config.Lease is -1s"},
		{"negative grace", server.Config{Postgres: pool, Redis: rdb, ReconcileGrace: -time.Second}, "Config.ReconcileGrace is -1s"},
		{"zero weight", server.Config{Postgres: pool, Redis: rdb, Queues: map[string]int{"low": 0}}, `Config.Queues["low"] is 0`},
		{"empty queue", server.Config{Postgres: pool, Redis: rdb, Queues: map[string]int{"": 1}}, "Config.Queues: a queue name is empty"},
		{"two leases", server.Config{Postgres: pool, Redis: rdb, Lease: time.Second, Ledger: &idempotency.Config{Lease: 2 * time.Second}},
			"Config.Lease (1s) and Config.Ledger.Lease (2s) differ"},
		{"two graces", server.Config{Postgres: pool, Redis: rdb, ReconcileGrace: time.Minute, Outbox: &outbox.Config{Grace: time.Hour}},
			"Config.ReconcileGrace (1m0s) and Config.Outbox.Grace (1h0m0s) differ"},
		{"short retention", server.Config{Postgres: pool, Redis: rdb, Retention: 24 * time.Hour},
			"Config.Retention 24h0m0s is shorter than TaskRetention plus the retry horizon of TaskMaxRetry retries plus the busy budget (517h0m0s)"},
		{"short retention for fewer retries", server.Config{Postgres: pool, Redis: rdb, Retention: 28 * time.Hour, TaskMaxRetry: 10},
			"(29h0m0s)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := server.New(tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("New = %v, %v; want an error containing %q", s, err, tc.wantErr)
			}
		})
	}
}

func TestMinRetention(t *testing.T) {
	t.Parallel()
	// The example tasks' rule: 24h retention, 10 retries, a 15m busy budget.
	if got, want := server.MinRetention(24*time.Hour, 10, 15*time.Minute).Round(time.Hour), 29*time.Hour; got != want {
		t.Errorf("MinRetention(24h, 10, 15m) = %v, want %v", got, want)
	}
	// The defaults fit the default retention.
	if got := server.MinRetention(server.DefaultTaskRetention, server.DefaultTaskMaxRetry, 15*time.Minute); got > server.DefaultRetention {
		t.Errorf("MinRetention of the defaults = %v, over the default retention %v", got, server.DefaultRetention)
	}
}

func TestPoolSize(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		concurrency, cores int
		want               int32
	}{{10, 2, 14}, {100, 2, 16}, {100, 8, 40}, {1, 64, 5}} {
		if got := server.PoolSize(tc.concurrency, tc.cores); got != tc.want {
			t.Errorf("PoolSize(%d, %d) = %d, want %d", tc.concurrency, tc.cores, got, tc.want)
		}
	}
}

func TestRunRefusesToRunWithoutHandlersOrTwice(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	s, err := server.New(server.Config{Postgres: e.pool, Redis: e.rdb})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Run(context.Background()); err == nil || !strings.Contains(err.Error(), "no handlers") {
		t.Fatalf("Run without handlers = %v, want an error", err)
	}
	if err := s.Run(context.Background()); err == nil || !strings.Contains(err.Error(), "Run called twice") {
		t.Fatalf("second Run = %v, want an error", err)
	}
	defer func() {
		if recover() == nil {
			t.Fatal("Handle after Run did not panic")
		}
	}()
	s.Handle("late", asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
}

// The default decoder is the library's strict one followed by the job's Validate; a
// custom one replaces both.
func TestDecoders(t *testing.T) {
	t.Parallel()
	if _, err := server.Decode[transfer]([]byte(`{"account":"a","cents":1,"ref":"r"} 1`)); err == nil {
		t.Error("Decode took trailing data")
	}
	if _, err := server.Decode[transfer]([]byte(`{"account":"a","cents":-1,"ref":"r"}`)); err == nil || !strings.Contains(err.Error(), "cents: must be positive") {
		t.Errorf("Decode of a negative amount = %v, want Validate's error", err)
	}
	got, err := server.Decode[transfer]([]byte(`{"account":"a","cents":1,"ref":"r"}`))
	if want := (transfer{Account: "a", Cents: 1, Ref: "r"}); err != nil || got != want {
		t.Errorf("Decode = %+v, %v; want %+v", got, err, want)
	}

	e := newEnv(t)
	ctx := testenv.Context(t, time.Minute)
	s, err := server.New(server.Config{Postgres: e.pool, Redis: e.rdb, ShutdownTimeout: 5 * time.Second,
		Worker: &asynqmw.Config{ScopeWait: time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	var decoded atomic.Int64
	server.HandleTx(s, typeTransfer, func(ctx context.Context, tx pgx.Tx, j transfer) (json.RawMessage, error) {
		_, err := tx.Exec(ctx, `INSERT INTO transfers (account, cents, ref) VALUES ($1, $2, $3)`, j.Account, j.Cents, j.Ref)
		return nil, err
	}, server.WithDecoder(func(b []byte) (transfer, error) {
		decoded.Add(1)
		return transfer{Account: "a", Cents: 1, Ref: string(b)}, nil
	}))
	run(t, s)
	client := asynq.NewClientFromRedisClient(e.rdb)
	defer client.Close()
	if _, err := client.EnqueueContext(ctx, asynq.NewTask(typeTransfer, []byte("raw"))); err != nil {
		t.Fatal(err)
	}
	waitCompleted(t, s, "transfer:raw", 30*time.Second)
	if decoded.Load() == 0 {
		t.Fatal("the custom decoder was not called")
	}
}

// tick is a periodic job's payload: the scheduler's fields and the entry's.
type tick struct {
	schedule.Tick
	Label string `json:"label"`
}

// A Server given Config.Schedule runs a scheduler replica: two Servers, each ticks once,
// the jobs of an @every 1s entry run, each tick once; a bad entry is refused by New.
func TestRunSchedulesPeriodicJobs(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	testenv.Exec(t, e.pool, `CREATE TABLE ticks (key text NOT NULL)`)
	entries := []schedule.Entry{{Name: "every-second", Schedule: "@every 1s", TaskType: "report:tick", Payload: json.RawMessage(`{"label":"x"}`)}}
	if _, err := server.New(server.Config{Postgres: e.pool, Redis: e.rdb,
		Schedule: []schedule.Entry{{Name: "bad", Schedule: "@every 1s"}}}); err == nil || !strings.Contains(err.Error(), `entry "bad": task_type`) {
		t.Fatalf("New with an entry without a task type: %v, want an error naming it", err)
	}
	var stops []func() error
	for range 2 {
		s, err := server.New(server.Config{Postgres: e.pool, Redis: e.rdb, Concurrency: 4, ShutdownTimeout: 5 * time.Second,
			Schedule: entries, Scheduler: &schedule.Config{Poll: 200 * time.Millisecond}})
		if err != nil {
			t.Fatal(err)
		}
		server.HandleTx(s, "report:tick", func(ctx context.Context, tx pgx.Tx, j tick) (json.RawMessage, error) {
			_, err := tx.Exec(ctx, `INSERT INTO ticks VALUES ($1)`, j.Key())
			return nil, err
		})
		stops = append(stops, run(t, s))
	}
	time.Sleep(4 * time.Second)
	for _, stop := range stops {
		if err := stop(); err != nil {
			t.Fatal(err)
		}
	}
	keys := testenv.Strings(t, e.pool, `SELECT key FROM ticks ORDER BY key`)
	if len(keys) < 2 {
		t.Fatalf("%d ticks ran in 4 s of @every 1s, want at least 2: %v", len(keys), keys)
	}
	for i := 1; i < len(keys); i++ {
		if keys[i] == keys[i-1] {
			t.Errorf("tick %s ran twice", keys[i])
		}
	}
	if n := testenv.Count(t, e.pool, `SELECT count(*) FROM job_intents WHERE idempotency_key LIKE 'cron:every-second:%'`); n < len(keys) {
		t.Errorf("%d intents for %d ticks run", n, len(keys))
	}
}

// syncBuffer is a bytes.Buffer safe for a logger's concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Without a Logger the Server logs to slog.Default, at the level its handler enables: a
// failed delivery is not lost. Not parallel: it replaces the process's default logger.
func TestNewLogsToTheDefaultLogger(t *testing.T) {
	var out syncBuffer
	prev := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelInfo})))
	t.Cleanup(func() { slog.SetDefault(prev) })

	e := newEnv(t)
	ctx := testenv.Context(t, time.Minute)
	s, err := server.New(server.Config{Postgres: e.pool, Redis: e.rdb, ShutdownTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	server.HandleLeased(s, typeNotice, func(ctx context.Context, j notice) (json.RawMessage, error) {
		return nil, errors.New("provider said no")
	})
	run(t, s)
	j := spec(t, typeNotice, notice{Order: "refused"})
	j.MaxRetry = 0
	if _, err := s.Outbox().Enqueue(ctx, j); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(out.String(), "provider said no") {
		if time.Now().After(deadline) {
			t.Fatalf("no line about the failed delivery in slog.Default's output after 30s:\n%s", out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if got := out.String(); !strings.Contains(got, "level=WARN msg=\"task failed\"") || !strings.Contains(got, "task_type="+typeNotice) {
		t.Errorf("the failed delivery's line is not a warning naming the task type:\n%s", got)
	}
}
