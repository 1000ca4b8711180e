package idempotency

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency/internal/claimctx"
	"github.com/idemq/idemq/idempotency/internal/commit"
	"github.com/idemq/idemq/idempotency/internal/sharedtx"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// Statuses of a ledger row (the status column).
const (
	StatusInProgress     = store.StatusInProgress
	StatusCompleted      = store.StatusCompleted
	StatusFailed         = store.StatusFailed
	StatusNeedsAttention = store.StatusNeedsAttention
)

// Event names what happened to a key, for counters (see Config.Observe).
type Event string

// Events passed to Config.Observe.
const (
	EventClaimed        Event = "claimed"                 // a new key was claimed
	EventTakeover       Event = "takeover"                // an expired lease was taken over
	EventCacheHit       Event = "cache_hit"               // a completed key answered with its stored result
	EventBusy           Event = "busy"                    // another claim holds the key
	EventMismatch       Event = "mismatch"                // the key was claimed with another fingerprint
	EventFailedKey      Event = "failed_key"              // the key is terminal failed; not run again
	EventNeedsAttention Event = "needs_attention"         // the key is (or was just marked) needs_attention
	EventCompleted      Event = sharedtx.EventCompleted   // a completion was recorded
	EventRetry          Event = "retry"                   // a retryable failure ended the lease
	EventFailed         Event = sharedtx.EventFailed      // a permanent failure was recorded
	EventLeaseLost      Event = "lease_lost"              // a fenced write matched no row (ErrLeaseLost)
	EventSelfFenced     Event = "self_fenced"             // no heartbeat reached the database in time
	EventBadResult      Event = "bad_result"              // a result was replaced by an error marker
	EventCommitResolved Event = "commit_resolved"         // a commit outcome was learned from its transaction id
	EventCommitUnknown  Event = "commit_unknown"          // a commit outcome stayed unknown (ErrCommitUnknown): the delivery retries
	EventSharedRun      Event = sharedtx.EventSharedRun   // a DoTx handler ran in a shared transaction without a savepoint
	EventSharedRerun    Event = sharedtx.EventSharedRerun // its shared transaction rolled back: the delivery runs alone
	EventGivenBack      Event = sharedtx.EventGivenBack   // a shared transaction's budget ran out first: its claim is undone, it runs alone
	EventTxConflict     Event = sharedtx.EventConflict    // a DoTx finish found a row changed since its read: its transaction's members run again
	EventLineStalled    Event = sharedtx.EventLineStalled // a DoTx delivery waited 30 s in its Request.Scope's line (it keeps waiting)
)

// StepOutcome names how a Step or StepTx call ended, for counters (see
// Config.ObserveStep) and as its span's idemq.outcome.
type StepOutcome string

// Step outcomes passed to Config.ObserveStep.
const (
	StepRan       StepOutcome = "ran"        // fn ran and its result was recorded
	StepCached    StepOutcome = "cached"     // an earlier delivery recorded the step: fn did not run
	StepLeaseLost StepOutcome = "lease_lost" // the claim no longer holds the key: nothing recorded
	StepMismatch  StepOutcome = "mismatch"   // recorded with another input or at another position (ErrStepMismatch)
	StepError     StepOutcome = "error"      // fn failed, or its result or record could not be stored
)

// Tables passed to Config.ObservePurge.
const (
	PurgeLedger      = "processed_jobs"       // terminal rows past the window, with their intents and steps
	PurgeDeadIntents = "job_intents"          // dead intents past the window whose key has no row
	PurgeEvents      = "processed_job_events" // a day of keys' histories past the window, dropped whole
)

// Kinds of shared commit passed to Config.ObserveBatch.
const (
	BatchClaim     = "claim"     // leased claims (Do)
	BatchComplete  = "complete"  // leased completions and failures (Do)
	BatchTx        = "tx"        // DoTx deliveries sharing a transaction
	BatchHeartbeat = "heartbeat" // leases of running Do handlers, extended together
)

// Config tunes a Ledger. The zero value of each field means its default.
type Config struct {
	// Lease is how long a claim holds a key without a heartbeat, by the database clock.
	// Do heartbeats every Lease/3. Default 30s.
	Lease time.Duration
	// HeartbeatPool serves heartbeats, so that pressure on the main pool cannot starve
	// them. Default: a pool of at most 2 connections the Ledger opens with the main pool's
	// configuration, closed by Ledger.Close.
	HeartbeatPool *pgxpool.Pool
	// SQL is the database/sql pool DoSQLTx takes its transactions from, on the ledger's
	// database: pgx's stdlib (stdlib.OpenDBFromPool, say) or lib/pq. Default: one over
	// the ledger's pool (stdlib.OpenDBFromPool), opened at the first DoSQLTx.
	SQL *sql.DB
	// SQLDriver vouches for SQL's driver when it is a wrapper (otelsql and the like)
	// around one of the two supported ones: "pgx" or "pq". Default: SQL's driver must be
	// one of them itself (see CheckSQL).
	SQLDriver string
	// TracerProvider makes Do's spans (idemq.claim, idemq.handler, idemq.complete, under
	// the caller's span, and idemq.step for each Step and StepTx call, under the handler's). Default: the global one (otel.GetTracerProvider), a no-op unless
	// the program installed one.
	TracerProvider trace.TracerProvider
	// ClaimLockTimeout bounds how long a claim waits for another session's row lock
	// (SET LOCAL lock_timeout) before reporting busy. Default 2s.
	ClaimLockTimeout time.Duration
	// SessionTimeout is the idle_in_transaction_session_timeout of DoTx transactions (cut
	// further to the request's deadline), so a frozen worker's row lock ends. Default 30s.
	SessionTimeout time.Duration
	// MaxResultBytes caps a stored result. Default 1 MiB.
	MaxResultBytes int
	// MaxAge is how long a key may stay in progress: an expired lease older than this is
	// marked needs_attention instead of being taken over. Default 24h.
	MaxAge time.Duration
	// SelfFenceMargin is subtracted from the lease when Do decides that it can no longer
	// be sure to hold it: the handler is cancelled at (send time of the last successful
	// heartbeat + lease - margin), on the local monotonic clock. Default Lease/10.
	SelfFenceMargin time.Duration
	// WriteTimeout bounds Complete and Fail, which run detached from the caller's
	// cancellation (context.WithoutCancel) so a cancelled delivery can still record what
	// happened. Default 10s.
	WriteTimeout time.Duration
	// Logger receives lease losses, self-fencing and replaced results. Default: discard.
	Logger *slog.Logger
	// UnsafeNoFencing is for negative-control tests only: fenced writes (Heartbeat,
	// Complete, Fail, the DoTx completion) stop checking the fence and owner, and Do stops
	// fencing itself, so a stale owner can extend, complete or overwrite what a newer owner
	// holds. It exists to show what fencing prevents. Never set it for real work.
	UnsafeNoFencing bool
	// DisableGroupCommit makes every claim, completion and DoTx commit in a transaction
	// of its own. By default concurrent requests of one process share commits: leased
	// claims and completions are sent together in one transaction (group commit), and
	// DoTx deliveries run one after another in a shared transaction, each in a savepoint
	// of its own. Either way no caller is answered before its own write is durable.
	DisableGroupCommit bool
	// MaxBatch caps how many requests one shared commit carries. Default 64.
	MaxBatch int
	// Committers caps how many shared transactions of each kind (leased claims, leased
	// completions) are in flight at once. Default 1: one committer per kind and process,
	// so that everything that queues behind a commit goes in the next one. DoTx runs up to
	// twice as many shared transactions: the second starts only while more deliveries
	// wait than the first's next batch takes, so that a transaction running its members
	// one after another does not leave the other cores idle.
	Committers int
	// ObserveBatch, if set, is called with the number of requests each shared commit
	// carried; kind is BatchClaim, BatchComplete, BatchTx or BatchHeartbeat. It must be fast and safe for
	// concurrent use.
	ObserveBatch func(kind string, size int)
	// Observe, if set, is called for each Event with the request's task type, for
	// metrics. It must be fast and safe for concurrent use.
	Observe func(ev Event, taskType string)
	// ObserveStep, if set, is called once for each Step and StepTx call with the job's
	// task type, the step's name and how the call ended, for metrics. Calls refused before
	// they name a valid step of a leased claim (ErrNoClaim, ErrStepInTx, a nested StepTx, a
	// bad name) are not reported. It must be fast and safe for concurrent use.
	ObserveStep func(taskType, step string, outcome StepOutcome)
	// ObserveHistory, if set, is called with how many events of keys' histories were
	// written (HistoryWritten), dropped from a full buffer (HistoryDropped) or lost to a
	// failed write (HistoryFailed). It must be fast and safe for concurrent use.
	ObserveHistory func(outcome string, n int)
	// ObservePurge, if set, is called after each batch statement of Purge (and so of the
	// retention round) with the table it purged (PurgeLedger: completed and failed rows,
	// with their intents and steps; PurgeDeadIntents: dead intents without a row;
	// PurgeEvents: a day of keys' histories, dropped whole, its rows estimated from its
	// statistics), how many rows it deleted and how long it took. It must be fast and
	// safe for concurrent use.
	ObservePurge func(table string, rows int64, took time.Duration)
	// ObservePurgeBacklog, if set, is called after each round of RunRetention with the
	// rows the round left to purge: 0 when it caught up; when it stopped at its budget (or
	// on an error), the terminal rows and dead intents past the window, counted from the
	// purge's indexes and capped at 1,000,000 of each, so that the count stays cheap. A
	// round that could not count reports nothing. Only the process that ran the round
	// knows the value: it stands for validFor (three intervals of the retention rounds),
	// and a process that has run no round since should stop reporting it, so that a stale
	// value is never read as the backlog. Purge alone does not call it. It must be fast
	// and safe for concurrent use. Default: nil, not reported.
	ObservePurgeBacklog func(rows int64, validFor time.Duration)
	// NoDuplicateHistory leaves cached duplicates (a delivery of a completed key answered
	// from the ledger) out of keys' histories; Observe still counts them (EventCacheHit).
	// Each recorded duplicate costs a row: on a load whose deliveries are mostly
	// duplicates, that row is most of what the ledger writes. Other kinds are recorded.
	NoDuplicateHistory bool
}

// Ledger records, per idempotency key, whether a piece of work is claimed, completed or
// failed, in the processed_jobs table. It is safe for concurrent use.
type Ledger struct {
	pool      *pgxpool.Pool
	hbPool    *pgxpool.Pool
	tracer    trace.Tracer
	ownHBPool bool
	cfg       Config
	log       *slog.Logger

	lockTimeoutSQL string        // set_config value for lock_timeout, e.g. "2000ms"
	writes         *store.Writes // store.Fenced, or store.Unfenced under Config.UnsafeNoFencing
	// prepare: the batch statements are named prepared statements, cached per
	// connection, as pgx caches its own under its default exec mode. A pool whose
	// default_query_exec_mode caches no statements (exec, simple_protocol,
	// cache_describe: what a transaction-mode pooler needs) gets them unnamed.
	prepare bool

	leased *commit.Committer[*leasedOp] // leased claims and finishes (Do)
	keeper *keeper                      // the leases of running Do handlers
	tx     *sharedtx.Exec               // DoTx transactions
	hist   *history                     // keys' history events not written yet

	sqlOnce sync.Once
	sqlDB   *sql.DB // DoSQLTx's: Config.SQL, or one over pool (ownSQL), once CheckSQL ran
	ownSQL  bool
	sqlErr  error // why Config.SQL cannot serve DoSQLTx
}

// New returns a Ledger on pool, whose connections must see the processed_jobs table
// (search_path). A nil cfg means all defaults. Call Close when done with it.
func New(pool *pgxpool.Pool, cfg *Config) *Ledger {
	l := &Ledger{pool: pool}
	if cfg != nil {
		l.cfg = *cfg
	}
	c := &l.cfg
	if c.Lease <= 0 {
		c.Lease = 30 * time.Second
	}
	if c.ClaimLockTimeout <= 0 {
		c.ClaimLockTimeout = 2 * time.Second
	}
	if c.SessionTimeout <= 0 {
		c.SessionTimeout = 30 * time.Second
	}
	if c.MaxResultBytes <= 0 {
		c.MaxResultBytes = 1 << 20
	}
	if c.MaxAge <= 0 {
		c.MaxAge = 24 * time.Hour
	}
	if c.SelfFenceMargin <= 0 {
		c.SelfFenceMargin = c.Lease / 10
	}
	if c.MaxBatch <= 0 {
		c.MaxBatch = 64
	}
	if c.Committers <= 0 {
		c.Committers = 1
	}
	if c.WriteTimeout <= 0 {
		c.WriteTimeout = 10 * time.Second
	}
	l.log = c.Logger
	if l.log == nil {
		l.log = slog.New(slog.DiscardHandler)
	}
	tp := c.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	l.tracer = tp.Tracer("github.com/idemq/idemq/idempotency")
	l.hbPool = c.HeartbeatPool
	if l.hbPool == nil {
		pc := pool.Config()
		pc.MaxConns = 2
		pc.MinConns = 0
		if p, err := pgxpool.NewWithConfig(context.Background(), pc); err == nil {
			l.hbPool, l.ownHBPool = p, true
		} else {
			// Cannot happen with a configuration taken from a working pool; fall back to it.
			l.log.Error("idempotency: open heartbeat pool; heartbeats share the main pool", "err", err)
			l.hbPool = pool
		}
	}
	l.writes = store.Fenced
	if c.UnsafeNoFencing {
		l.writes = store.Unfenced
	}
	l.prepare = pool.Config().ConnConfig.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement
	l.hist = &history{l: l, max: historyBuffer, delay: HistoryFlushDelay}
	l.leased = l.newLeasedCommitter()
	l.keeper = newKeeper(l)
	l.lockTimeoutSQL = fmt.Sprintf("%dms", max(1, c.ClaimLockTimeout.Milliseconds()))
	l.tx = sharedtx.New(sharedtx.Config{
		Pool: pool, Writes: l.writes, MaxBatch: c.MaxBatch, Committers: c.Committers,
		WriteTimeout: c.WriteTimeout, ClaimLockTimeout: c.ClaimLockTimeout, SessionTimeout: c.SessionTimeout, MaxAge: c.MaxAge,
		MaxResultBytes: c.MaxResultBytes, Alone: c.DisableGroupCommit, Permanent: IsPermanent,
		Observe:      func(ev, taskType string) { l.observe(Event(ev), taskType) },
		ObserveBatch: func(n int) { l.observeBatch(BatchTx, n) },
		Tracer:       l.tracer,
		Events:       l.hist,
		Stalled: func(scope, key string, waited time.Duration) {
			l.log.Error("idempotency: a delivery waits in its scope's line: the scope's deliveries before it have not ended", "scope", scope, "key", key, "waited", waited)
		},
	})
	return l
}

// Close writes the history events not written yet (see Record) and closes the heartbeat
// pool and the *sql.DB the Ledger opened, if it opened them. It does not close the pools passed in. Do not
// use the Ledger after Close.
func (l *Ledger) Close() {
	l.hist.close()
	if l.ownSQL {
		l.sqlDB.Close()
	}
	if l.ownHBPool {
		l.hbPool.Close()
	}
}

func (l *Ledger) observeBatch(kind string, size int) {
	if l.cfg.ObserveBatch != nil {
		l.cfg.ObserveBatch(kind, size)
	}
}

func (l *Ledger) observe(ev Event, taskType string) {
	if l.cfg.Observe != nil {
		l.cfg.Observe(ev, taskType)
	}
}

// Request names one piece of work to claim.
type Request struct {
	// Key is the idempotency key, derived from intent (charge:order-123). See ValidateKey.
	Key string
	// TaskType is the task's type name, 1..255 bytes.
	TaskType string
	// Fingerprint identifies the payload: nil, or 32 bytes (see Fingerprint). When both
	// the stored and the requested fingerprint are set and differ, the claim fails with
	// a *MismatchError. A nil fingerprint is not compared.
	Fingerprint []byte
	// Deadline is the delivery's own deadline (zero: none). A lease is never extended
	// past it.
	Deadline time.Time
	// Scope (DoTx only; empty: none) names deliveries that must not run at the same time in
	// this process, such as one account's: concurrent DoTx calls of one scope take turns,
	// and those that meet run one after another in one shared transaction. It does not
	// reach other processes (the asynq middleware's Redis lock does). At most 255 bytes.
	Scope string
	// TaskID and PayloadSum identify the delivered task, for the key's outbox intent: a
	// completion or permanent failure settles the intent only when the task is the
	// intent's own — TaskID the key or key#r<n> (IntentKey) and PayloadSum (see
	// PayloadSum) its payload's — and never because another producer's task completed the
	// key. The asynq middleware sets both. With TaskID empty, a completion settles the
	// key's intent whatever task it ran.
	TaskID     string
	PayloadSum []byte
}

func (r *Request) validate() error {
	if err := ValidateKey(r.Key); err != nil {
		return err
	}
	if n := len(r.TaskType); n < 1 || n > 255 {
		return fmt.Errorf("%w: task type is %d bytes, must be 1..255", ErrInvalidRequest, n)
	}
	if len(r.Scope) > MaxKeyBytes {
		return fmt.Errorf("%w: scope is %d bytes, must be at most %d", ErrInvalidRequest, len(r.Scope), MaxKeyBytes)
	}
	if r.Fingerprint != nil && len(r.Fingerprint) != sha256.Size {
		return fmt.Errorf("%w: fingerprint is %d bytes, must be %d or none", ErrInvalidRequest, len(r.Fingerprint), sha256.Size)
	}
	return nil
}

// MaxKeyBytes is the longest valid key, in bytes.
const MaxKeyBytes = 255

// ValidateKey reports whether key can be an idempotency key: 1..255 bytes, each printable
// ASCII other than space (0x21..0x7E) and '#', which is reserved for the TaskIDs of
// republishes (key#r<n>), so that no key can ever name another key's republish. It checks
// what the processed_jobs and job_intents CHECK constraints check. The error wraps
// ErrInvalidKey and names the limit broken.
func ValidateKey(key string) error {
	if len(key) == 0 {
		return fmt.Errorf("%w: empty, must be 1..%d bytes", ErrInvalidKey, MaxKeyBytes)
	}
	if len(key) > MaxKeyBytes {
		return fmt.Errorf("%w: %d bytes, must be 1..%d bytes", ErrInvalidKey, len(key), MaxKeyBytes)
	}
	for i := 0; i < len(key); i++ {
		if problem := KeyByteProblem(key[i]); problem != "" {
			return fmt.Errorf("%w: byte 0x%02x at offset %d, %s", ErrInvalidKey, key[i], i, problem)
		}
	}
	return nil
}

// KeyByteProblem says why c cannot be a byte of a key ("" when it can), for checks that
// name their own field: keys are printable ASCII other than space and ReservedKeyByte.
func KeyByteProblem(c byte) string {
	switch {
	case c < 0x21 || c > 0x7e:
		return "must be printable ASCII 0x21..0x7E (no space, control or non-ASCII)"
	case c == ReservedKeyByte:
		return "'#' is reserved (republished tasks are key#r<n>)"
	}
	return ""
}

// ReservedKeyByte may not appear in a key: it separates a key from its republish
// generation in asynq TaskIDs (key#r<n>).
const ReservedKeyByte = '#'

// Fingerprint returns sha256(taskType || 0x00 || canonicalPayload), the value for
// Request.Fingerprint. canonicalPayload should be json.Marshal of the strictly decoded
// payload, so that equal payloads give equal fingerprints.
func Fingerprint(taskType string, canonicalPayload []byte) []byte {
	h := sha256.New()
	h.Write([]byte(taskType))
	h.Write([]byte{0})
	h.Write(canonicalPayload)
	return h.Sum(nil)
}

func withClaim(ctx context.Context, key string, fence int64) context.Context {
	return claimctx.With(ctx, key, fence)
}

// NewContext returns ctx carrying key with fence 0, which no claim has: what FromContext
// reports to a handler run without the ledger (its own tests, an unguarded baseline).
func NewContext(ctx context.Context, key string) context.Context {
	return claimctx.With(ctx, key, 0)
}

// FromContext returns the key and fence of the claim a Do or DoTx handler runs under.
// Pass the key (never key+fence) to external providers as their idempotency key. ok is
// false outside such a handler.
func FromContext(ctx context.Context) (key string, fence int64, ok bool) {
	return claimctx.From(ctx)
}

// Lease returns the lease a claim holds a key for without a heartbeat (Config.Lease).
func (l *Ledger) Lease() time.Duration { return l.cfg.Lease }

// SelfFenceMargin returns Config.SelfFenceMargin: how long before a lease's end, by the
// local clock, Do cancels a handler that no heartbeat has confirmed (see LeaseDeadline).
func (l *Ledger) SelfFenceMargin() time.Duration { return l.cfg.SelfFenceMargin }
