package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemq/idemq/idempotency/internal/store"
)

// Record is a ledger row, for operators (Get, List). Times are the database clock's; a
// zero time means NULL.
type Record struct {
	Key         string
	TaskType    string
	Status      string // StatusInProgress, StatusCompleted, StatusFailed or StatusNeedsAttention
	Fence       int64
	Owner       string // the UUID of the latest claim ("" if none)
	Generation  int
	Fingerprint []byte
	Result      json.RawMessage
	Attempts    int
	LastError   string
	LockedUntil time.Time
	// LeaseLive reports, for an in-progress row, whether its lease was still running when
	// it was read (on the database clock): false means the lease lapsed at LockedUntil and
	// the next delivery takes the key over. Always false for other statuses.
	LeaseLive   bool
	CreatedAt   time.Time
	UpdatedAt   time.Time
	StartedAt   time.Time
	CompletedAt time.Time
	// TraceID is the trace of the delivery whose claim holds or did the work, "" when that
	// delivery was not traced.
	TraceID string
}

func scanRecord(row pgx.Row) (Record, error) {
	var (
		r                                   Record
		owner                               pgtype.UUID
		gen, attempts                       int32
		lastError, traceID                  pgtype.Text
		lockedUntil, completedAt            pgtype.Timestamptz
		result                              []byte
		createdAt, updatedAt, startedAtTime time.Time
	)
	err := row.Scan(&r.Key, &r.TaskType, &r.Status, &r.Fence, &owner, &gen, &r.Fingerprint,
		&result, &attempts, &lastError, &lockedUntil, &createdAt, &updatedAt, &startedAtTime, &completedAt, &traceID, &r.LeaseLive)
	if err != nil {
		return Record{}, err
	}
	if owner.Valid {
		r.Owner = formatUUID(owner.Bytes)
	}
	if result != nil {
		r.Result = json.RawMessage(result)
	}
	r.Generation, r.Attempts, r.LastError, r.TraceID = int(gen), int(attempts), lastError.String, traceID.String
	r.LockedUntil, r.CompletedAt = lockedUntil.Time, completedAt.Time
	r.LeaseLive = r.LeaseLive && r.Status == StatusInProgress
	r.CreatedAt, r.UpdatedAt, r.StartedAt = createdAt, updatedAt, startedAtTime
	return r, nil
}

// Get returns key's row, or an error wrapping ErrNotFound. Safe for concurrent use.
func (l *Ledger) Get(ctx context.Context, key string) (*Record, error) {
	r, err := scanRecord(l.pool.QueryRow(ctx, store.GetSQL, key))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("%w: %q", ErrNotFound, key)
	}
	if err != nil {
		return nil, fmt.Errorf("idempotency: get %s: %w", key, err)
	}
	return &r, nil
}

// GetMany returns the rows of keys the ledger holds, by key, in one statement; a key it
// does not hold is absent from the map. Safe for concurrent use.
func (l *Ledger) GetMany(ctx context.Context, keys []string) (map[string]*Record, error) {
	// Planned for its keys each time: a generic plan made while the table was small
	// would scan it whole.
	rows, err := l.pool.Query(ctx, store.GetManySQL, pgx.QueryExecModeCacheDescribe, keys)
	if err != nil {
		return nil, fmt.Errorf("idempotency: get: %w", err)
	}
	recs, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Record, error) { return scanRecord(row) })
	if err != nil {
		return nil, fmt.Errorf("idempotency: get: %w", err)
	}
	out := make(map[string]*Record, len(recs))
	for i := range recs {
		out[recs[i].Key] = &recs[i]
	}
	return out, nil
}

// unknownStatus is the error for a status that is not one of the four, naming them.
func unknownStatus(status string) error {
	return fmt.Errorf("%w: unknown status %q: want %s, %s, %s or %s", ErrInvalidRequest, status,
		StatusInProgress, StatusCompleted, StatusFailed, StatusNeedsAttention)
}

// List returns up to limit rows (all when limit <= 0) with the given status, or of every
// status when status is "", most recently updated first. It scans the table; it is meant
// for operators, not for hot paths. Safe for concurrent use.
func (l *Ledger) List(ctx context.Context, status string, limit int) ([]Record, error) {
	switch status {
	case "", StatusInProgress, StatusCompleted, StatusFailed, StatusNeedsAttention:
	default:
		return nil, unknownStatus(status)
	}
	var lim any
	if limit > 0 {
		lim = limit
	}
	rows, err := l.pool.Query(ctx, store.ListSQL, status, lim)
	if err != nil {
		return nil, fmt.Errorf("idempotency: list: %w", err)
	}
	recs, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Record, error) { return scanRecord(row) })
	if err != nil {
		return nil, fmt.Errorf("idempotency: list: %w", err)
	}
	return recs, nil
}

// CountStatus returns how many rows have the given status. In progress and needs
// attention are read from an index of the open rows; completed and failed scan the
// table: count those for a gauge at most every few tens of seconds, not per delivery.
// Safe for concurrent use.
func (l *Ledger) CountStatus(ctx context.Context, status string) (int64, error) {
	switch status {
	case StatusInProgress, StatusCompleted, StatusFailed, StatusNeedsAttention:
	default:
		return 0, unknownStatus(status)
	}
	var n int64
	if err := l.pool.QueryRow(ctx, store.CountSQL, status).Scan(&n); err != nil {
		return 0, fmt.Errorf("idempotency: count: %w", err)
	}
	return n, nil
}

// Release forces key's in-progress lease to end now: the next delivery takes the key
// over at once, and the current holder can no longer heartbeat or complete
// (ErrLeaseLost). For a leased effect that may already have happened, the next run calls
// the provider again with the same key. It waits for a DoTx transaction holding the row.
// It returns an error wrapping ErrNotFound, or ErrNotInProgress for a row in another
// status. Safe for concurrent use.
func (l *Ledger) Release(ctx context.Context, key string) error {
	tag, err := l.pool.Exec(ctx, store.ReleaseSQL, key)
	if err != nil {
		return fmt.Errorf("idempotency: release %s: %w", key, err)
	}
	if tag.RowsAffected() == 1 {
		return nil
	}
	return l.statusError(ctx, key, ErrNotInProgress)
}

// Reopened is what Ledger.Rerun did.
type Reopened struct {
	// Generation is the row's new generation.
	Generation int
	// TaskID is the TaskID under which the relays publish the key's outbox intent again
	// ("<key>#r<n>"), or "" when the key has no intent (its task was enqueued without the
	// outbox, or the intent was purged): then nothing was republished, and the next
	// delivery of the key, under a TaskID asynq does not hold yet, runs it.
	TaskID string
}

// Rerun reopens key, which must be completed, failed or needs_attention (or in progress
// under a lapsed lease with a dead outbox intent: a job whose task asynq archived when its
// retries ran out), as a new generation whose lease has already ended (the stored result is dropped; attempts and
// last_error are kept), and, in the same statement, hands the key's outbox intent, if it
// has one, back to the relays to publish under a TaskID no publish of it has used yet
// (key#r<n>, n one past the highest republish so far): a worker runs the job again
// without anyone enqueueing it, and the intent is no longer done until that run
// completes. It is the only way a terminal key runs again. It returns the new generation
// and TaskID, or an error wrapping ErrNotFound or ErrNotTerminal. Safe for concurrent use.
func (l *Ledger) Rerun(ctx context.Context, key string) (Reopened, error) {
	var (
		gen     int32
		pubGen  pgtype.Int4
		notices int64
	)
	err := l.pool.QueryRow(ctx, store.RerunSQL, key, outboxWakeChannel, store.Worker).Scan(&gen, &pubGen, &notices)
	if errors.Is(err, pgx.ErrNoRows) {
		return Reopened{}, l.statusError(ctx, key, ErrNotTerminal)
	}
	if err != nil {
		return Reopened{}, fmt.Errorf("idempotency: rerun %s: %w", key, err)
	}
	r := Reopened{Generation: int(gen)}
	if pubGen.Valid {
		r.TaskID = key + "#r" + strconv.Itoa(int(pubGen.Int32))
	}
	l.log.Info("idempotency: key reopened by an operator", "key", key, "generation", gen, "task_id", r.TaskID)
	return r, nil
}

// outboxWakeChannel is the LISTEN/NOTIFY channel the outbox's relays wait on.
const outboxWakeChannel = "idemq_outbox"

// statusError explains why an operator update matched no row.
func (l *Ledger) statusError(ctx context.Context, key string, wrong error) error {
	r, err := l.Get(ctx, key)
	if err != nil {
		return err
	}
	return fmt.Errorf("%w: %q is %s", wrong, key, r.Status)
}

// Purge deletes completed and failed rows that completed more than olderThan ago, with
// their outbox intents and recorded steps, and then dead intents that finished more than
// olderThan ago and whose key has no row (their task's payload was refused, say), in
// transactions of at most batch rows (default 1000 when batch <= 0), until none is left
// or ctx ends. Keys' histories go by the day: it drops each day of events that ended more
// than olderThan ago, and readies the partitions of the coming week.
// In-progress and needs_attention rows (and their intents) are never purged. It returns
// how many rows and dead intents it deleted; the dead intents are also logged, as such. A
// key delivered or enqueued again after it is purged runs again: keep the window longer
// than anything can still deliver the key. Safe for concurrent use.
func (l *Ledger) Purge(ctx context.Context, olderThan time.Duration, batch int) (int64, error) {
	n, _, err := l.purge(ctx, olderThan, batch, time.Time{})
	return n, err
}

// purge is Purge stopping after the first batch that ends past deadline (unless deadline
// is zero). caughtUp means that both of its purges ran until a batch found fewer rows than
// it may delete; it is false when purge stopped at deadline or on an error, leaving rows
// past the window.
func (l *Ledger) purge(ctx context.Context, olderThan time.Duration, batch int, deadline time.Time) (n int64, caughtUp bool, err error) {
	if olderThan < 0 {
		return 0, false, fmt.Errorf("%w: negative purge window %s", ErrInvalidRequest, olderThan)
	}
	if batch <= 0 {
		batch = 1000
	}
	// The coming days of history first, so that a backlog of rows never keeps them
	// waiting; the days past the window last, so that a detach held up by an open
	// transaction never keeps the rows waiting.
	now := time.Now()
	if herr := l.readyHistory(ctx, now); herr != nil {
		defer func() { err = errors.Join(err, fmt.Errorf("idempotency: purge history: %w", herr)) }()
	}
	defer func() {
		if _, herr := l.dropHistory(ctx, now, olderThan); herr != nil {
			err = errors.Join(err, fmt.Errorf("idempotency: purge history: %w", herr))
		}
	}()
	rows, caughtUp, err := l.purgeBatches(ctx, PurgeLedger, store.PurgeSQL, olderThan, batch, deadline)
	if err != nil {
		return rows, false, fmt.Errorf("idempotency: purge: %w", err)
	}
	if !caughtUp {
		return rows, false, nil
	}
	dead, caughtUp, err := l.purgeBatches(ctx, PurgeDeadIntents, store.PurgeDeadIntentsSQL, olderThan, batch, deadline)
	if dead > 0 {
		l.log.Info("idempotency: purged dead intents without a ledger row", "count", dead, "older_than", olderThan)
	}
	if err != nil {
		return rows + dead, false, fmt.Errorf("idempotency: purge dead intents: %w", err)
	}
	return rows + dead, caughtUp, nil
}

// purgeBatches runs sql, a purge of one batch of table answering how many it deleted,
// until a batch deletes fewer than batch (caughtUp) or one ends past deadline (unless it
// is zero); each batch is its own statement and transaction, reported to
// Config.ObservePurge.
func (l *Ledger) purgeBatches(ctx context.Context, table, sql string, olderThan time.Duration, batch int, deadline time.Time) (total int64, caughtUp bool, err error) {
	for {
		var n int64
		began := time.Now()
		if err := l.pool.QueryRow(ctx, sql, olderThan.Microseconds(), batch).Scan(&n); err != nil {
			return total, false, err
		}
		if l.cfg.ObservePurge != nil {
			l.cfg.ObservePurge(table, n, time.Since(began))
		}
		total += n
		if n < int64(batch) {
			return total, true, nil
		}
		if !deadline.IsZero() && time.Now().After(deadline) {
			return total, false, nil
		}
	}
}

// purgeBacklogCap bounds each table's count of the rows a retention round left to purge
// (Config.ObservePurgeBacklog).
const purgeBacklogCap = 1_000_000

// purgeBacklog counts the rows Purge(olderThan) would still delete, at most
// purgeBacklogCap of the ledger's and as many dead intents, from the indexes the purge
// reads them from.
func (l *Ledger) purgeBacklog(ctx context.Context, olderThan time.Duration) (int64, error) {
	var n int64
	if err := l.pool.QueryRow(ctx, store.PurgeBacklogSQL, olderThan.Microseconds(), purgeBacklogCap).Scan(&n); err != nil {
		return 0, fmt.Errorf("idempotency: count the purge's backlog: %w", err)
	}
	return n, nil
}

// MarkStuck turns every in-progress row whose lease has ended and whose generation
// started more than Config.MaxAge ago into needs_attention, and returns how many it
// changed. Claim does the same for the key it meets; MarkStuck finds the ones no delivery
// comes back for. Safe for concurrent use.
func (l *Ledger) MarkStuck(ctx context.Context) (int64, error) {
	tag, err := l.pool.Exec(ctx, store.MarkStuckSQL, l.cfg.MaxAge.Microseconds())
	if err != nil {
		return 0, fmt.Errorf("idempotency: mark stuck: %w", err)
	}
	if n := tag.RowsAffected(); n > 0 {
		l.log.Warn("idempotency: in-progress rows past the maximum age need attention", "count", n)
	}
	return tag.RowsAffected(), nil
}
