// Package sharedtx is the ledger's DoTx executor: deliveries that commit their work in the
// ledger's database queue for a transaction, and each transaction carries several of them,
// one after another on one connection, with one multi-row claim before them and one
// multi-row finish (with the COMMIT) after. A delivery comes in as data (Delivery: its
// key, its payload's fingerprint, its deadline, its work) and goes back as data (Outcome:
// what the read found, what the finish stored, the handler's error); the ledger turns
// the outcome into a result, an error and its logs. The executor owns the transaction
// and runs each handler on it, on its own goroutine, with the pgx.Tx each handler gets
// (handlerTx, txshim.go); it owns savepoints, the budget and the fall-backs to
// transactions of their own.
package sharedtx

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency/internal/commit"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// Budget is how long a shared transaction runs its members' handlers (their time outside
// the database; wallBudgets of them in wall time): the members still waiting when it is
// spent give their claims back (in the finish) and run in transactions of their own, in
// parallel. Sharing pays when handlers take about as long as a claim and
// a commit; a handler that sleeps or waits on a slow query would otherwise hold up every
// member after it. On a loaded machine every turn is slower (a round trip and two
// goroutine wake-ups, each waiting for a core): at 5 ms, three worker processes on two
// cores carried 3.4 debits per transaction and ran at half the rate of one; at 20 ms,
// 9–10 and three quarters of it.
const Budget = 20 * time.Millisecond

// SavepointsFor is how long shared transactions give each member a savepoint after one
// that ran its members without savepoints rolled back (a handler failed, or the finish was
// refused): a steady rate of business errors must not run every handler twice.
const SavepointsFor = 5 * time.Second

// wallBudgets is how many budgets of wall time a shared transaction runs its members'
// turns (handlers and round trips) before the members still waiting give their claims
// back: a handler waiting on a slow query holds up every member after it. Handlers that
// spend the budget outside the database give the rest back at once (Budget).
const wallBudgets = 5

// SlowHandler is the average handler time outside the database (handlerTx.InDB) above
// which deliveries stop sharing transactions and run alone, in parallel, until handlers
// are quick again.
const SlowHandler = time.Millisecond

// Events the executor reports through Config.Observe.
const (
	EventClaimed     = "claimed"      // a new key was claimed
	EventTakeover    = "takeover"     // an expired lease was taken over
	EventBadResult   = "bad_result"   // a result was replaced by an error marker
	EventSharedRun   = "shared_run"   // a handler ran in a shared transaction without a savepoint
	EventSharedRerun = "shared_rerun" // its shared transaction rolled back: the delivery runs alone
	EventGivenBack   = "given_back"   // a shared transaction's budget ran out first: the claim is undone
	EventConflict    = "tx_conflict"  // a finish found a row other than its read did: the transaction's members run again
	EventCompleted   = "completed"    // a completion was committed
	EventFailed      = "failed"       // a permanent failure was committed
	EventLineStalled = "line_stalled" // a delivery waited StallAfter in its scope's line
)

// StallAfter is how long a delivery waits in its scope's line before the wait is
// reported (Config.Stalled, EventLineStalled): a scope's units take milliseconds, so a
// line this slow holds a handler that waits on something, or a bug that keeps the scope
// from moving. The delivery keeps waiting, within its own deadline.
const StallAfter = 30 * time.Second

// Fn is a delivery's work, run on the transaction.
type Fn func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error)

// Delivery is one DoTx call: its key's identity and its work.
type Delivery struct {
	Key, TaskType string
	Fingerprint   []byte // the payload's; nil: not compared
	IntentSum     []byte // see store.FinishParams.IntentSum
	TraceID       string // the delivery's, "" when it is not traced
	Deadline      time.Time
	// Scope names the deliveries that must not overlap in this process (empty: none but
	// the key's own): they take turns, several to a shared transaction when they meet.
	Scope string
	Fn    Fn
	// SQL is the work of a DoSQLTx delivery (Exec.RunSQL), in place of Fn.
	SQL SQLFn
}

// StatementError is the error of the executor's own work on the database, not a
// handler's: taking a connection, the claim, a result's store, the undo of a member's
// savepoint, the finish and its COMMIT. The ledger tells from it whether Postgres was
// unavailable; a handler's error (a query of its own that timed out, an error it returns)
// never carries it.
type StatementError struct{ Err error }

func (e *StatementError) Error() string { return e.Err.Error() }
func (e *StatementError) Unwrap() error { return e.Err }

// own marks err, not nil, as the executor's own (StatementError).
func own(err error) error { return &StatementError{Err: err} }

// Outcome is how a delivery ended.
type Outcome struct {
	// Verdict and Row are the last read of the key. Claimed: the key was taken (Row's
	// Fence is the claim's, Attempts its attempt, Owner the claim's owner); otherwise Row
	// answers the delivery (a stored result, or why the key was not taken; Race: the
	// finish kept finding the row changed since the read).
	Verdict store.Verdict
	Row     store.ClaimRow
	Owner   pgtype.UUID
	// Out is the handler's result; Stored and LastErr what the finish stored for it.
	Out             json.RawMessage
	Stored, LastErr pgtype.Text
	// XID and ServerStart identify the transaction that wrote the row.
	XID, ServerStart string
	// Err is the handler's error, or the executor's own (StatementError).
	Err error
	// Refused: the server refused the claim (Verdict Unread), or the claimed row's write
	// or its result (a *pgconn.PgError).
	Refused error
	// Lost: the commit's answer was lost: resolve it from the transaction id.
	Lost error
	// Recorded: a permanent failure was committed (with the batch, or, for a delivery
	// claimed alone, in a transaction after the one that rolled back). Unrecorded: why
	// one was not (its read answers the delivery instead when the key was decided or held
	// meanwhile).
	Recorded   bool
	Unrecorded error
	// alone: the shared transaction could not decide this delivery (a lost race, an
	// undone transaction, a turn past the budget): it runs in a transaction of its own.
	alone bool
}

// Config is what the executor needs of the ledger.
type Config struct {
	Pool   *pgxpool.Pool
	Writes *store.Writes // fenced, or not (the negative control)
	// MaxBatch caps the members of one transaction; Committers the transactions that run
	// at once (twice as many while deliveries queue deeper than one takes).
	MaxBatch, Committers int
	WriteTimeout         time.Duration
	ClaimLockTimeout     time.Duration
	SessionTimeout       time.Duration // idle_in_transaction_session_timeout, cut to the deadline
	MaxAge               time.Duration
	MaxResultBytes       int
	// Alone: every delivery in a transaction of its own (Config.DisableGroupCommit).
	Alone        bool
	Permanent    func(error) bool // a failure recorded for good
	Observe      func(ev, taskType string)
	ObserveBatch func(size int)
	// Stalled, if set, is told of a delivery that waited StallAfter in its scope's line.
	Stalled func(scope, key string, waited time.Duration)
	// Tracer, if set, makes a span of each transaction two or more recorded deliveries
	// share (see batchSpan).
	Tracer trace.Tracer
	// Events, if set, hands the keys' history events waiting for a write to each finish.
	Events Events
}

// Events are the keys' history events waiting in the ledger for a round to carry them.
type Events interface {
	// TakeForCommit takes the events a finish is to carry after its COMMIT (none: nil).
	TakeForCommit() []store.EventParams
	// Done reports the finish that carried them: commitErr is the finish's error (when
	// its COMMIT did not happen, neither did the events' statement), eventsErr theirs.
	Done(events []store.EventParams, commitErr, eventsErr error)
}

// Exec runs deliveries in transactions. Safe for concurrent use.
type Exec struct {
	cfg            Config
	lockTimeoutSQL string
	q              *commit.Queue[*member]
	handlers       times // how long handlers take outside the database
	turns          times // how long a member's turn in a shared transaction takes
	// Budget (Budget), Slow (SlowHandler) and StallAfter (StallAfter) may be changed by
	// tests before use.
	Budget, Slow, StallAfter time.Duration
	mu                       sync.Mutex
	scopes                   map[string]*line // the scopes with a unit queued or running
	// savepointsUntil (Unix nanoseconds): until then shared transactions give each member
	// a savepoint, as after an optimistic one rolled back (SavepointsFor).
	savepointsUntil atomic.Int64
}

// New returns an executor.
func New(cfg Config) *Exec {
	return &Exec{
		cfg:            cfg,
		lockTimeoutSQL: fmt.Sprintf("%dms", max(1, cfg.ClaimLockTimeout.Milliseconds())),
		q:              commit.NewQueueSpare(1, cfg.Committers, cfg.Committers, func(m *member) string { return m.d.Key }),
		Budget:         Budget,
		Slow:           SlowHandler,
		StallAfter:     StallAfter,
		scopes:         map[string]*line{},
	}
}

// Queued is how many deliveries wait for a shared transaction.
func (e *Exec) Queued() int { return e.q.Len() }

// SavepointsUntil makes shared transactions give each member a savepoint until t (as
// after a rollback): for tests.
func (e *Exec) SavepointsUntil(t time.Time) { e.savepointsUntil.Store(t.UnixNano()) }

// Optimistic reports whether shared transactions run their members without savepoints now.
func (e *Exec) Optimistic() bool { return time.Now().UnixNano() >= e.savepointsUntil.Load() }

// Run runs d: in a transaction shared with concurrent deliveries, or in one of its own
// (Config.Alone, handlers slow, or when the shared one could not decide it). A panic of
// d.Fn is raised again on the caller's goroutine after the transaction rolled back.
func (e *Exec) Run(ctx context.Context, d Delivery) Outcome {
	if d.Scope != "" {
		return e.scoped(ctx, d)
	}
	if e.cfg.Alone || e.handlers.slow(e.Slow) {
		// Handlers this slow gain nothing from sharing a connection: alone, side by side.
		return e.alone(ctx, d, 0, !e.cfg.Alone)
	}
	return e.shared(ctx, d)
}

// shared queues d, and the executor that takes it hands the claimed transaction to this
// goroutine for d's turn (member).
func (e *Exec) shared(ctx context.Context, d Delivery) Outcome {
	m := newMember(ctx, d, false)
	m.timed = true
	e.push(m)
	o := e.await(m, func() bool { return e.q.Leave(0, m) })
	if o.alone {
		return e.alone(ctx, d, 1, false)
	}
	return o
}

// push queues m for a shared transaction, starting an executor when one more may run.
func (e *Exec) push(m *member) {
	if e.q.PushDeep(0, m, e.turns.fit(e.Budget, e.cfg.MaxBatch)) {
		go e.runBatches()
	}
}

// await waits for m's outcome (the executor runs m's fn on the transaction), and panics
// again with m's fn's panic.
// When m's ctx ends first, leave takes m out of where it waits (false: a batch took it
// already, and answers it, at the latest when its turn comes).
func (e *Exec) await(m *member, leave func() bool) Outcome {
	done := m.ctx.Done()
	for {
		select {
		case <-done:
			if leave() {
				return Outcome{Err: fmt.Errorf("idempotency: claim %s: %w", m.d.Key, m.ctx.Err())}
			}
			done = nil
		case o := <-m.answer:
			if m.panicked { // its fn, run by the executor; the transaction rolled back
				panic(m.pval)
			}
			return o
		}
	}
}

// alone runs d in a transaction of its own: a batch of one, run on the caller's
// goroutine, from claim round round on, until it is decided.
// timed: fn's run time joins the moving average (member.timed).
func (e *Exec) alone(ctx context.Context, d Delivery, round int, timed bool) Outcome {
	for ; ; round++ {
		m := newMember(ctx, d, true)
		m.round, m.timed = round, timed
		// A connection that does not come within the write timeout is the database's
		// doing, one that the caller stopped waiting for is the caller's.
		actx, cancel := context.WithTimeout(ctx, e.cfg.WriteTimeout)
		conn, err := e.cfg.Pool.Acquire(actx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return Outcome{Err: fmt.Errorf("idempotency: claim %s: %w", d.Key, ctx.Err())}
			}
			return Outcome{Err: own(fmt.Errorf("idempotency: claim %s: %w", d.Key, err))}
		}
		e.runBatch(conn.Conn(), []*member{m})
		conn.Release() // the pool closes a connection left in a transaction
		o := <-m.answer
		if m.panicked {
			panic(m.pval)
		}
		if !o.alone {
			return o
		}
	}
}

// The deliveries of one scope (Delivery.Scope) never overlap in this process. They wait
// in the scope's line, and one unit of the scope runs at a time: a batch, which takes the
// line's waiting deliveries with it (up to the batch's size, one per key) and runs them
// one after another in its transaction, or one delivery alone on its own goroutine (when
// deliveries do not share transactions now). A delivery its batch could not decide (a
// lost race, a refused claim, its turn past the budget, an undone transaction) goes back
// to the head of its line, instead of running alone beside the scope's next unit.

// Waiting is how many deliveries of scope wait in its line: for tests.
func (e *Exec) Waiting(scope string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	if ln := e.scopes[scope]; ln != nil {
		return len(ln.waiting)
	}
	return 0
}

// batchSpan starts, when two or more of ms are traced, the span of the transaction they
// share, "idemq.shared_tx" (see commit.StartSpan).
func (e *Exec) batchSpan(ms []*member) trace.Span {
	if e.cfg.Tracer == nil || len(ms) < 2 {
		return nil
	}
	var traced commit.SpanMembers
	for _, m := range ms {
		traced.Add(trace.SpanFromContext(m.ctx))
	}
	return commit.StartSpan(e.cfg.Tracer, "idemq.shared_tx", len(ms), traced)
}

func (e *Exec) acquire() (*pgxpool.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), e.cfg.WriteTimeout)
	defer cancel()
	return e.cfg.Pool.Acquire(ctx)
}

func (e *Exec) observe(ev string, m *member) { e.observeType(ev, m.d.TaskType) }

func (e *Exec) observeType(ev, taskType string) {
	if e.cfg.Observe != nil {
		e.cfg.Observe(ev, taskType)
	}
}

func (e *Exec) observeBatch(n int) {
	if e.cfg.ObserveBatch != nil {
		e.cfg.ObserveBatch(n)
	}
}

// idleTimeout is the idle_in_transaction_session_timeout of a transaction whose members'
// latest deadline is deadline (zero: none): Config.SessionTimeout, cut to the time left.
func (e *Exec) idleTimeout(deadline time.Time) string {
	idle := e.cfg.SessionTimeout
	if !deadline.IsZero() {
		idle = max(min(idle, time.Until(deadline)), time.Millisecond)
	}
	return strconv.FormatInt(max(1, idle.Milliseconds()), 10) + "ms"
}

// times is a moving average of a duration.
type times struct{ nanos atomic.Int64 }

// record adds a run time to the moving average (weight 1/8).
func (h *times) record(d time.Duration) {
	for {
		old := h.nanos.Load()
		if h.nanos.CompareAndSwap(old, old+(int64(d)-old)/8) {
			return
		}
	}
}

// slow reports whether runs take longer than limit, on average.
func (h *times) slow(limit time.Duration) bool { return time.Duration(h.nanos.Load()) > limit }

// fit is how many members fit in budget, at the average time, within 2..most: never
// one, as only a transaction of several members measures a member's turn, and a
// transaction whose second member does not fit gives it back. (A member given back costs
// a claim and a finish for nothing: the estimate does not round up.)
func (h *times) fit(budget time.Duration, most int) int {
	avg := time.Duration(h.nanos.Load())
	if avg <= 0 {
		return most
	}
	return max(min(2, most), min(most, int(budget/avg)))
}
