package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/internal/commit"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// Intent states (the job_intents.state column).
const (
	IntentPending   = "pending"   // recorded, not yet handed to asynq
	IntentPublished = "published" // handed to asynq; not completed yet
	IntentDone      = "done"      // the ledger completed the key
	IntentDead      = "dead"      // the ledger failed the key permanently
)

// Config tunes a Client. The zero value of each field means its default.
type Config struct {
	// RelayBatch is how many pending intents one relay round publishes. Default 100.
	RelayBatch int
	// Relays caps the relay rounds RunRelay runs at once (see RunRelay). Default 4.
	Relays int
	// RelayPoll is how often the relay looks for pending intents without a wake-up.
	// Default 500ms.
	RelayPoll time.Duration
	// RelayHold is how long a relay holds the intents it took before another relay may
	// take them (if it died mid-publish). Default 30s.
	RelayHold time.Duration
	// Grace is how long a published intent may be missing from Redis before the
	// reconciler republishes it; it must exceed asynq's own recovery of a crashed
	// worker's task (60–120 s). Default 3m.
	Grace time.Duration
	// ReconcileEvery is how often the reconciler runs with the grace period, besides at
	// once when Redis lost data (see ProbeEvery). Default 30s.
	ReconcileEvery time.Duration
	// ProbeEvery is how often the reconciler compares each queue's epoch marker in Redis
	// (and Redis's run_id) with Postgres's, to republish at once what Redis lost.
	// Default 2s.
	ProbeEvery time.Duration
	// RepublishPerSecond bounds republishes. Default 500.
	RepublishPerSecond float64
	// AlertGeneration: republishing an intent for this generation or later is logged as an
	// error and counted. Default 3.
	AlertGeneration int
	// Committers caps the rounds of Enqueue calls (and of publishes at once) in flight
	// at once. Default 4.
	Committers int
	// MaxBatch caps the intents one round of Enqueue calls records. Default 256.
	MaxBatch int
	// WriteTimeout bounds each round of Enqueue calls. Default 10s.
	WriteTimeout time.Duration
	// Listen configures the connection RunRelay LISTENs on for the wake-ups other
	// processes' Wake send. Default: the pool's configuration. It must reach Postgres
	// itself or a session pooler: behind a transaction-mode pooler (PgBouncer's
	// pool_mode=transaction) a LISTEN hears nothing and pins a server connection, so
	// RunRelay checks, and finding one it does not listen: relays then wake on this
	// Client's own Wake calls and poll every RelayPoll.
	Listen *pgx.ConnConfig
	// TracerProvider makes the span of each publish of a traced job (one recorded with a
	// traceparent): a producer span "publish <task type>" in the job's trace. Default: the
	// global one (otel.GetTracerProvider).
	TracerProvider trace.TracerProvider
	// Logger receives relay and reconciler lines. Default: discard.
	Logger *slog.Logger
	// Observe, if set, is called for each outbox event (EventPublished, EventRepublished,
	// EventRepublishAlert, EventRelayError, EventArchived) with the task type. Fast, concurrency-safe.
	Observe func(ev Event, taskType string)
}

// Event names what the outbox did, for counters (see Config.Observe).
type Event string

// Events passed to Config.Observe.
const (
	EventPublished      Event = "published"       // the relay handed an intent to asynq
	EventRepublished    Event = "republished"     // the reconciler republished a lost task
	EventRepublishAlert Event = "republish_alert" // a republish reached Config.AlertGeneration
	EventRelayError     Event = "relay_error"     // a publish failed; retried later
	EventArchived       Event = "archived"        // the reconciler settled dead an intent whose own task asynq archived
)

// EnqueueResult is the outcome of recording a job.
type EnqueueResult struct {
	// Key is the job's idempotency key: poll the ledger with it.
	Key string
	// Duplicate is true when the key was recorded before (with the same payload).
	Duplicate bool
	// State is the intent's state after the call.
	State string
}

// Client records jobs in the outbox (job_intents) and publishes them to asynq. Postgres is
// the source of truth for accepted work: a recorded intent is published by a relay and,
// if Redis loses it, republished by the reconciler, until the ledger completes or fails
// the key. A Client is safe for concurrent use.
type Client struct {
	pool  *pgxpool.Pool
	rdb   redis.UniversalClient
	asynq *asynq.Client
	insp  *asynq.Inspector
	cfg   Config
	log   *slog.Logger

	tracer    trace.Tracer
	wake      chan struct{} // this process's relays, woken by Wake and by notifications
	wakeMu    sync.Mutex
	lastWake  time.Time
	wakeLater bool // a wake-up is due at the end of the window

	epochQueues sync.Map // queue → true once its redis_epochs row is known to exist

	enq *commit.Committer[*enqueueOp] // Enqueue's shared rounds
	pub *commit.Committer[*publishOp] // Publish's
}

// NewClient returns a Client recording intents in pool's database and publishing through
// rdb (which it does not close). cfg may be nil.
func NewClient(pool *pgxpool.Pool, rdb redis.UniversalClient, cfg *Config) *Client {
	c := &Client{pool: pool, rdb: rdb, asynq: asynq.NewClientFromRedisClient(rdb), insp: asynq.NewInspectorFromRedisClient(rdb),
		wake: make(chan struct{}, 1)}
	if cfg != nil {
		c.cfg = *cfg
	}
	d := &c.cfg
	if d.RelayBatch <= 0 {
		d.RelayBatch = 100
	}
	if d.Relays <= 0 {
		d.Relays = 4
	}
	if d.RelayPoll <= 0 {
		d.RelayPoll = 500 * time.Millisecond
	}
	if d.RelayHold <= 0 {
		d.RelayHold = 30 * time.Second
	}
	if d.Grace <= 0 {
		d.Grace = 3 * time.Minute
	}
	if d.ReconcileEvery <= 0 {
		d.ReconcileEvery = 30 * time.Second
	}
	if d.ProbeEvery <= 0 {
		d.ProbeEvery = 2 * time.Second
	}
	if d.RepublishPerSecond <= 0 {
		d.RepublishPerSecond = 500
	}
	if d.AlertGeneration <= 0 {
		d.AlertGeneration = 3
	}
	if d.Committers <= 0 {
		d.Committers = 4
	}
	if d.MaxBatch <= 0 {
		d.MaxBatch = 256
	}
	if d.WriteTimeout <= 0 {
		d.WriteTimeout = 10 * time.Second
	}
	c.log = d.Logger
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	tp := d.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	c.tracer = tp.Tracer("github.com/idemq/idemq/idempotency/outbox")
	c.newCommitters()
	return c
}

func (c *Client) observe(ev Event, taskType string) {
	if c.cfg.Observe != nil {
		c.cfg.Observe(ev, taskType)
	}
}

// EnqueueTx records spec's intent inside tx, the caller's own transaction: the job is
// accepted exactly when tx commits, together with the caller's other writes, and a relay
// publishes it after the commit (call Wake after committing to publish at once). The
// traceparent of ctx's span (or spec.TraceParent) is recorded with the intent: every
// delivery of the job continues that trace.
//
// Recording a key that exists already changes nothing: with the same payload it reports
// Duplicate and the intent's state; with another payload (or task type) it returns a
// *MismatchError. An invalid key returns an error wrapping ErrInvalidKey. A concurrent
// uncommitted EnqueueTx of the same key makes this one wait for it.
func (c *Client) EnqueueTx(ctx context.Context, tx pgx.Tx, spec Spec) (EnqueueResult, error) {
	return enqueueOne(ctx, pgxIntents{tx}, spec)
}

// EnqueueSQLTx is EnqueueTx in a database/sql transaction (GORM's, sqlx's, ent's, bun's
// or sqlc's, on pgx's stdlib or lib/pq): the intent commits with the caller's own writes,
// and a rolled-back tx leaves no intent. It returns what EnqueueTx returns.
func (c *Client) EnqueueSQLTx(ctx context.Context, tx *sql.Tx, spec Spec) (EnqueueResult, error) {
	return enqueueOne(ctx, sqlIntents{tx}, spec)
}

// enqueueOne records spec's intent in tx: a batch of one, whose statements are
// EnqueueManyTx's.
func enqueueOne(ctx context.Context, tx intentTx, spec Spec) (EnqueueResult, error) {
	res, errs, err := enqueueMany(ctx, tx, []Spec{withTrace(ctx, spec)}, 0)
	if err != nil {
		return EnqueueResult{}, err
	}
	return res[0], errs[0]
}

// IntentInfo is an intent's row (job_intents), for the API and operators.
type IntentInfo struct {
	Key               string
	TaskType          string
	State             string
	PublishGeneration int
	// LastError is, while the intent is pending, why its last publish failed; once it is
	// dead, why its task was refused (a mismatch, a failed key, an invalid payload).
	LastError   string
	CreatedAt   time.Time
	PublishedAt time.Time
	FinishedAt  time.Time
	// TraceParent is the W3C traceparent recorded with the intent ("" when none).
	TraceParent string
}

// TraceID is the trace id of i's TraceParent, "" when it has none.
func (i *IntentInfo) TraceID() string {
	sc := trace.SpanContextFromContext(idempotency.ContextWithTraceParent(context.Background(), i.TraceParent))
	if !sc.IsValid() {
		return ""
	}
	return sc.TraceID().String()
}

// DB is what the package's functions run their statements on: a *pgxpool.Pool, a
// *pgx.Conn or a pgx.Tx.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Intent returns key's intent, or an error wrapping ErrNotFound.
func (c *Client) Intent(ctx context.Context, key string) (*IntentInfo, error) {
	return ReadIntent(ctx, c.pool, key)
}

// ReadIntent returns key's intent as q (a pool, a connection, a transaction) sees it, or
// an error wrapping ErrNotFound: Client.Intent for a program without a Client.
func ReadIntent(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, key string) (*IntentInfo, error) {
	i, err := store.ReadIntent(ctx, q, key)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("%w: no intent for %q", idempotency.ErrNotFound, key)
	}
	if err != nil {
		return nil, err
	}
	info := IntentInfo(i)
	return &info, nil
}

// UnfinishedIntents returns up to limit intents still pending or published (accepted, not
// yet completed or failed), oldest first.
func (c *Client) UnfinishedIntents(ctx context.Context, limit int) ([]IntentInfo, error) {
	rows, err := store.UnfinishedIntents(ctx, c.pool, limit)
	if err != nil {
		return nil, err
	}
	out := make([]IntentInfo, len(rows))
	for i, r := range rows {
		out[i] = IntentInfo(r)
	}
	return out, nil
}

// IntentQueues returns the queue each of keys' intents was recorded for, by key, as q
// (a pool, a connection, a transaction) sees them; a key without an intent is absent.
func IntentQueues(ctx context.Context, q DB, keys []string) (map[string]string, error) {
	return store.IntentQueues(ctx, q, keys)
}

// TaskID is the asynq TaskID of the intent's current publish: the key, or key#r<n> after
// n republishes.
func (i *IntentInfo) TaskID() string { return taskID(i.Key, i.PublishGeneration) }

// Wake asks every relay to look for pending intents now (this Client's at once, the others
// by a NOTIFY outside any transaction); call it after committing EnqueueTx. A Client sends at most one per 20 ms:
// a call inside that window is folded into one sent at its end, so no commit waits for a
// relay's poll. Errors are only logged: the relays poll anyway.
func (c *Client) Wake(ctx context.Context) {
	c.signal()
	c.wakeMu.Lock()
	if wait := wakeEvery - time.Since(c.lastWake); wait > 0 {
		if !c.wakeLater {
			c.wakeLater = true
			time.AfterFunc(wait, func() {
				c.wakeMu.Lock()
				c.wakeLater, c.lastWake = false, time.Now()
				c.wakeMu.Unlock()
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				c.notify(ctx)
			})
		}
		c.wakeMu.Unlock()
		return
	}
	c.lastWake = time.Now()
	c.wakeMu.Unlock()
	c.notify(ctx)
}

// signal wakes this Client's relays.
func (c *Client) signal() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// wakeEvery is the shortest time between two wake-ups a Client sends.
const wakeEvery = 20 * time.Millisecond

func (c *Client) notify(ctx context.Context) {
	if err := store.Notify(ctx, c.pool, wakeChannel); err != nil {
		c.log.Debug("outbox wake-up", "err", err)
	}
}

// taskID is the TaskID of an intent's publish generation.
func taskID(key string, gen int) string {
	if gen == 0 {
		return key
	}
	return key + "#r" + strconv.Itoa(gen)
}
