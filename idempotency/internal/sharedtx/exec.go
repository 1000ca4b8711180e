// Package sharedtx is the ledger's DoTx executor: deliveries that commit their work in the
// ledger's database queue for a transaction, and each transaction carries several of them,
// one after another on one connection, with one multi-row claim before them and one
// multi-row finish (with the COMMIT) after. A delivery comes in as data (Delivery: its
// key, its payload's fingerprint, its deadline, its work) and goes back as data (Outcome:
// what the read found, what the finish stored, the handler's error); the ledger turns
// the outcome into a result, an error and its logs. The executor owns the transaction,
// the hand-over to each delivery's goroutine, savepoints, the budget and the fall-backs
// to transactions of their own.
package sharedtx

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency/internal/claimctx"
	"github.com/idemq/idemq/idempotency/internal/commit"
	"github.com/idemq/idemq/idempotency/internal/pgcode"
	"github.com/idemq/idemq/idempotency/internal/pgtext"
	"github.com/idemq/idemq/idempotency/internal/sharedspan"
	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/idempotency/internal/txshim"
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

// SlowHandler is the average handler time outside the database (txshim.Tx.InDB) above
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

// await waits for m's outcome, running m's fn when the executor hands m the transaction.
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
		case tx := <-m.run:
			r := m.runFn(tx)
			m.ran <- r
			if r.panicked {
				<-m.answer // rolled back
				panic(m.pval)
			}
		case o := <-m.answer:
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

// line is a scope's waiting deliveries; the scope is in Exec.scopes while a unit of it
// is queued or runs.
type line struct{ waiting []*member }

// requeueRounds bounds how often a delivery runs again after a conflict: then it is busy.
const requeueRounds = 5

// scoped is Run for a delivery with a scope.
func (e *Exec) scoped(ctx context.Context, d Delivery) Outcome {
	m := newMember(ctx, d, false)
	m.scope, m.timed = d.Scope, true
	e.mu.Lock()
	if ln := e.scopes[d.Scope]; ln != nil {
		ln.waiting = append(ln.waiting, m)
		e.mu.Unlock()
		stall := time.AfterFunc(e.StallAfter, func() { e.stalled(m) })
		defer stall.Stop()
	} else {
		e.scopes[d.Scope] = &line{}
		e.mu.Unlock()
		e.startUnit(m)
	}
	o := e.await(m, func() bool { return e.leaveLine(m) })
	if !o.alone {
		return o
	}
	// The scope's turn is this delivery's, alone, on this goroutine.
	defer e.release(d.Scope)
	return e.alone(ctx, d, m.round, !e.cfg.Alone)
}

// stalled reports m, which waited Exec.StallAfter in its scope's line.
func (e *Exec) stalled(m *member) {
	e.observe(EventLineStalled, m)
	if e.cfg.Stalled != nil {
		e.cfg.Stalled(m.scope, m.d.Key, e.StallAfter)
	}
}

// startUnit starts the scope's next unit with m at its head: queued for a batch, or
// alone when deliveries do not share transactions now.
func (e *Exec) startUnit(m *member) {
	if e.cfg.Alone || e.handlers.slow(e.Slow) {
		m.answer <- Outcome{alone: true}
		return
	}
	e.push(m)
}

// leaveLine takes m, whose caller gives up, out of its line or the queue, unless a batch
// took it already (then it reports false).
func (e *Exec) leaveLine(m *member) bool {
	e.mu.Lock()
	if ln := e.scopes[m.scope]; ln != nil {
		if i := slices.Index(ln.waiting, m); i >= 0 {
			ln.waiting = slices.Delete(ln.waiting, i, i+1)
			e.mu.Unlock()
			return true
		}
	}
	e.mu.Unlock()
	if e.q.Leave(0, m) {
		e.release(m.scope) // m headed the scope's unit
		return true
	}
	return false
}

// release ends a unit of scope: the line's next delivery starts the next unit, or the
// scope is forgotten.
func (e *Exec) release(scope string) {
	e.mu.Lock()
	ln := e.scopes[scope]
	if len(ln.waiting) == 0 {
		delete(e.scopes, scope)
		e.mu.Unlock()
		return
	}
	next := ln.waiting[0]
	ln.waiting = slices.Delete(ln.waiting, 0, 1)
	e.mu.Unlock()
	e.startUnit(next)
}

// withLines adds to the batch ms the deliveries waiting in the lines of its scoped
// members, up to n members in all, one per key, and sorts it by key.
func (e *Exec) withLines(ms []*member, n int) []*member {
	// ms is the queue's batch, which Done must get back as it was (the leads' keys are
	// in flight): the batch grows and is sorted in a copy.
	if !slices.ContainsFunc(ms, func(m *member) bool { return m.scope != "" }) {
		return ms
	}
	leads := ms
	ms = slices.Clone(ms)
	keys := make(map[string]bool, len(ms))
	for _, m := range ms {
		keys[m.d.Key] = true
	}
	e.mu.Lock()
	for _, lead := range leads {
		if lead.scope == "" {
			continue
		}
		ln := e.scopes[lead.scope]
		rest := ln.waiting[:0]
		for _, f := range ln.waiting {
			if len(ms) < n && !keys[f.d.Key] {
				keys[f.d.Key] = true
				ms = append(ms, f)
			} else {
				rest = append(rest, f)
			}
		}
		clear(ln.waiting[len(rest):])
		ln.waiting = rest
	}
	e.mu.Unlock()
	if len(ms) > len(leads) {
		slices.SortFunc(ms, func(a, b *member) int { return cmp.Compare(a.d.Key, b.d.Key) })
	}
	return ms
}

// afterLines ends the units of the scopes of the batch ms that ran: the members it sent
// back go to the head of their lines, and each scope's next unit starts.
func (e *Exec) afterLines(ms []*member) {
	if !slices.ContainsFunc(ms, func(m *member) bool { return m.scope != "" }) {
		return
	}
	var scopes []string
	back := map[string][]*member{}
	for _, m := range ms {
		if m.scope == "" {
			continue
		}
		if !slices.Contains(scopes, m.scope) {
			scopes = append(scopes, m.scope)
		}
		if m.requeue {
			m.requeue, m.answered, m.finish, m.later = false, false, finish{}, false
			back[m.scope] = append(back[m.scope], m)
		}
	}
	for _, s := range scopes {
		if b := back[s]; len(b) > 0 {
			e.mu.Lock()
			ln := e.scopes[s]
			ln.waiting = append(b, ln.waiting...)
			e.mu.Unlock()
		}
		e.release(s)
	}
}

// again has m run once more: in a transaction of its own, or, when it has a scope, in
// its line's next unit. After a conflict (its finish found the row changed since its
// read), that is so only up to requeueRounds: then the key is busy (store.Race).
func (b *batch) again(m *member, conflict bool) {
	switch {
	case m.answered:
	case conflict && m.round+1 >= requeueRounds:
		m.out.Verdict = store.Race
		b.reply(m, nil)
	case m.scope == "":
		m.out.alone = true
		b.reply(m, nil)
	default:
		m.answered, m.requeue = true, true
		m.round++
	}
}

// runBatches is an executor: it runs the queued deliveries in shared transactions on one
// connection, up to Config.MaxBatch (one per key, in key order) in each, until nothing is
// queued. Up to 2 × Config.Committers executors run at once.
func (e *Exec) runBatches() {
	var conn *pgxpool.Conn
	defer func() {
		if conn != nil {
			conn.Release()
		}
	}()
	for {
		// Take the connection first, so that members stay free to leave meanwhile.
		var acqErr error
		if conn == nil && e.q.Ready() {
			conn, acqErr = e.acquire()
		}
		n := e.turns.fit(e.Budget, e.cfg.MaxBatch)
		batches := e.q.Take(n)
		if batches == nil {
			return
		}
		ms := e.withLines(batches[0], n)
		if conn == nil && acqErr == nil {
			conn, acqErr = e.acquire()
		}
		if acqErr != nil {
			for _, m := range ms {
				m.answer <- Outcome{Err: own(fmt.Errorf("idempotency: claim %s: %w", m.d.Key, acqErr))}
			}
			e.q.Done(batches)
			e.afterLines(ms)
			continue
		}
		e.observeBatch(len(ms))
		span := e.batchSpan(ms)
		fit := e.runBatch(conn.Conn(), ms)
		if span != nil {
			span.End()
		}
		if !fit {
			conn.Release() // the pool closes a connection left in a transaction
			conn = nil
		}
		e.q.Done(batches)
		e.afterLines(ms)
	}
}

// batch is the state of one transaction, used by its executor only: the members' keys
// held and read in its first round trip (Writes.BeginClaims), each claimed member's
// handler, and one multi-row finish that writes every completed or failed member's row,
// with the COMMIT (Writes.FinishAndCommit). With several members claimed, each handler
// runs in a savepoint of its own (made when it first uses the transaction) unless the
// transaction is optimistic; a member claimed alone needs none: its failure rolls the
// whole transaction back. A member that failed leaves no row (a permanent failure: a
// failed one).
type batch struct {
	e    *Exec
	conn *pgx.Conn
	idle string // idle_in_transaction_session_timeout for the whole transaction

	xid, serverStart string // the transaction's id, drawn with the claims

	pre     []string      // statements sent ahead of the next round trip (a RELEASE)
	own     time.Duration // the members' handlers' time outside the database so far
	claimed []*member     // members whose rows the finish ends, in order
	broken  error         // the transaction cannot commit
	// optimistic: the members run without savepoints, their results stored by the finish;
	// undone: one of them failed, so the transaction rolls back and every member runs
	// alone (its outcome then is its outcome alone).
	optimistic, undone bool
}

// runBatch runs ms, sorted by key, in one transaction on conn, and answers each. It
// reports whether conn is fit for another batch.
func (e *Exec) runBatch(conn *pgx.Conn, ms []*member) bool {
	// The transaction lives across its members: its idle timeout is the longest any
	// member allows, so no member's short deadline cuts the others off.
	var latest time.Time
	for _, m := range ms {
		if m.d.Deadline.IsZero() {
			latest = time.Time{}
			break
		}
		if m.d.Deadline.After(latest) {
			latest = m.d.Deadline
		}
	}
	b := &batch{e: e, conn: conn, idle: e.idleTimeout(latest)}
	switch {
	case !b.claimAll(ms):
		// Nothing claimed (completed keys, busy ones): the transaction wrote nothing; end
		// it so that the connection goes back to the pool (or on to the next batch)
		// instead of being closed for a transaction left open.
		if b.broken == nil {
			b.rollback()
		}
	case len(b.claimed) == 1:
		b.runSolo(b.claimed[0])
	default:
		b.runShared()
	}
	if b.broken != nil {
		for _, m := range ms {
			b.reply(m, fmt.Errorf("idempotency: DoTx %s: the transaction did not commit; nothing recorded: %w", m.d.Key, b.broken))
		}
		b.rollback()
	}
	return !conn.IsClosed() && conn.PgConn().TxStatus() == 'I'
}

// claimAll begins the transaction, holds every member's key and reads its row, in one
// round trip. A member that is not claimed is answered at once (a completed key's result
// is committed data; a key another transaction holds is busy). When the server refuses
// (or the connection fails), nothing is claimed and every member gets the error. It
// reports whether any member was claimed.
func (b *batch) claimAll(ms []*member) bool {
	var ps []store.ClaimParams
	var live []*member
	for _, m := range ms {
		m.out = Outcome{}
		if err := m.ctx.Err(); err != nil {
			b.reply(m, fmt.Errorf("idempotency: claim %s: %w", m.d.Key, err))
			continue
		}
		if dl := m.d.Deadline; !dl.IsZero() && !time.Now().Before(dl) {
			b.reply(m, fmt.Errorf("idempotency: claim %s: the delivery deadline has passed: %w", m.d.Key, context.DeadlineExceeded))
			continue
		}
		owner, err := store.NewOwner()
		if err != nil {
			b.reply(m, fmt.Errorf("idempotency: owner id: %w", err))
			continue
		}
		m.out.Owner = owner
		ps = append(ps, store.ClaimParams{Key: m.d.Key, TaskType: m.d.TaskType, Owner: owner, Fingerprint: m.d.Fingerprint, TraceID: m.d.TraceID})
		live = append(live, m)
	}
	if len(live) == 0 {
		return false
	}
	ctx, cancel := b.ctx()
	defer cancel()
	// A delivery alone on its caller's goroutine waits for its key's lock, up to
	// ClaimLockTimeout, as a duplicate of a key another transaction runs should: it then
	// sees that transaction's row. A shared transaction waits for no key: a busy one must
	// not hold up the others.
	wait := len(live) == 1 && live[0].local
	t, err := b.e.cfg.Writes.BeginClaims(ctx, b.conn, b.idle, b.e.lockTimeoutSQL, wait, ps, b.e.cfg.MaxAge)
	if err != nil {
		if !store.Answered(err) {
			b.broken = own(err)
			return false
		}
		for _, m := range live {
			m.out.Refused = err
			b.reply(m, nil)
		}
		b.rollback()
		return false
	}
	b.xid, b.serverStart = t.XID, t.ServerStart
	for i, m := range live {
		if b.read(m, t.Rows[i]) {
			b.claimed = append(b.claimed, m)
		} else {
			b.reply(m, nil) // the row answers (a race, which no read of this kind finds, is busy)
		}
	}
	return len(b.claimed) > 0
}

// read sets m's outcome from its key's row as the transaction read it, and reports
// whether m took the key (EventClaimed, or EventTakeover).
func (b *batch) read(m *member, row store.ClaimRow) bool {
	m.out.Row, m.out.Verdict = row, row.Verdict(m.d.Fingerprint, b.e.cfg.MaxAge)
	switch {
	case m.out.Verdict != store.Claimed:
		return false
	case row.Attempts.Int32 > 1:
		b.e.observe(EventTakeover, m)
	default:
		b.e.observe(EventClaimed, m)
	}
	return true
}

// runSolo runs the one member a transaction claimed: no savepoint (its failure rolls the
// whole transaction back), and its row is written, with the COMMIT, in one round trip. A
// finish refused for a conflict (the row is not what the read found) has it run again. A
// permanent failure (the handler's, or a result jsonb refuses) is recorded after the
// rollback (record).
func (b *batch) runSolo(m *member) {
	if err := m.ctx.Err(); err != nil {
		b.rollback()
		b.reply(m, fmt.Errorf("idempotency: DoTx %s: %w", m.d.Key, err))
		return
	}
	r, ok := b.turn(m, nil)
	switch {
	case !ok:
		return
	case r.err != nil || r.panicked:
		b.rollback()
		if !r.panicked && b.e.cfg.Permanent(r.err) {
			b.record(m, failed(r.err.Error(), r.err))
			return
		}
		b.reply(m, r.err) // a panic is raised again
		return
	}
	b.complete(m, r.out)
	ctx, cancel := b.ctx()
	err := b.finishAndCommit(ctx, nil, []store.FinishParams{b.params(m)})
	cancel()
	var pgErr *pgconn.PgError
	switch {
	case store.Conflict(err):
		b.e.observe(EventConflict, m)
		b.rollback()
		b.again(m, true)
	case errors.As(err, &pgErr):
		b.rollback()
		m.out.Refused = pgErr
		if pgErr.Code[:2] == pgcode.DataExceptionClass {
			b.record(m, failed(refusedResult+pgErr.Message, nil)) // answered as refused
			return
		}
		b.reply(m, nil)
	default:
		b.answerCommitted(err)
	}
}

// record writes m's row failed (f) after m's handler failed for good in the transaction
// that just rolled back, taking its effects with it: in a new transaction on the same
// connection, which holds and reads m's key again (a fresh fence) and, if m may still
// take it, writes the row with the COMMIT (Outcome.Recorded). A read that finds the key
// decided or held meanwhile (or is refused, as busy) answers m instead: that claim
// decides. A finish refused (a conflict, counted) or a connection that fails leaves the
// failure unrecorded (Outcome.Unrecorded), and m answered as it failed. The record is
// the ledger's own write, as a Fail is: the caller's ctx and deadline do not cut it.
func (b *batch) record(m *member, f finish) {
	failure := m.out
	unrecorded := func(err error) {
		b.rollback()
		m.out, m.out.Unrecorded = failure, err
		b.reply(m, f.err)
	}
	ctx, cancel := b.ctx()
	t, err := b.e.cfg.Writes.BeginClaims(ctx, b.conn, b.e.idleTimeout(time.Time{}), b.e.lockTimeoutSQL, m.local,
		[]store.ClaimParams{{Key: m.d.Key, TaskType: m.d.TaskType, Owner: failure.Owner, Fingerprint: m.d.Fingerprint, TraceID: m.d.TraceID}}, b.e.cfg.MaxAge)
	cancel()
	m.out = Outcome{Owner: failure.Owner, Refused: failure.Refused}
	switch {
	case err != nil && !store.Answered(err):
		unrecorded(err)
		return
	case err != nil:
		b.rollback()
		m.out.Refused = err
		b.reply(m, nil)
		return
	case !b.read(m, t.Rows[0]):
		b.rollback()
		m.out.Refused = nil
		b.reply(m, nil)
		return
	}
	b.xid, b.serverStart, m.finish = t.XID, t.ServerStart, f
	ctx, cancel = b.ctx()
	_, err = b.e.cfg.Writes.FinishAndCommit(ctx, b.conn, nil, b.e.lockTimeoutSQL, []store.FinishParams{b.params(m)}, nil)
	cancel()
	if err != nil && (store.Answered(err) || !b.conn.IsClosed()) {
		if store.Conflict(err) {
			b.e.observe(EventConflict, m)
		}
		unrecorded(err)
		return
	}
	b.answerCommitted(err)
}

// runShared runs the claimed members one after another, within the budget, and commits
// them (or, undone, rolls back and has them run alone).
func (b *batch) runShared() {
	e := b.e
	b.optimistic = e.Optimistic()
	start := time.Now()
	ran := 0
	for _, m := range b.claimed {
		if b.broken != nil || b.undone {
			break
		}
		if b.own > e.Budget || time.Since(start) > e.Budget*wallBudgets {
			// Handlers this slow gain nothing from sharing a connection: the rest give
			// their claims back and run alone, side by side. What counts is the handlers'
			// own time, outside the database: on a saturated machine every turn takes
			// longer (a round trip and two wake-ups, each waiting for a core), which is
			// when sharing matters most, and a claim given back is a claim and a commit
			// more. Only a transaction that has run several budgets' worth of turns (a
			// handler waiting on a slow query) gives its rest back for its wall time.
			m.later = true
			e.observe(EventGivenBack, m)
			continue
		}
		if b.optimistic {
			b.runOptimistic(m)
		} else {
			b.runMember(m)
		}
		ran++
	}
	if ran > 0 {
		// A member's turn costs its handler and the round trips around it (its savepoint,
		// its result): a shared transaction takes only as many members as fit in the
		// budget at that cost, so that it gives none back.
		e.turns.record(time.Since(start) / time.Duration(ran))
	}
	if b.broken == nil && !b.undone {
		b.commit()
	}
	if b.undone && b.broken == nil {
		b.rollback()
		b.rerunAlone()
	}
}

// runOptimistic runs m's fn on the shared transaction without a savepoint: its result is
// stored by the finish. A handler that fails (or panics, or leaves the transaction
// aborted) undoes the whole transaction; every member then runs alone, a panicking one
// panics again.
func (b *batch) runOptimistic(m *member) {
	r, ok := b.turn(m, nil)
	switch {
	case !ok:
	case r.panicked:
		b.undone = true
		b.reply(m, nil) // the member panics again
	case r.err != nil:
		b.undone = true
	default:
		b.complete(m, r.out)
	}
}

// runMember runs m's fn on the shared transaction. The member's savepoint is made when fn
// first uses the transaction; it is released when fn succeeds and the server takes its
// result (its row is written by the finish) and rolled back when fn fails (its row is not
// written, or written failed).
func (b *batch) runMember(m *member) {
	saved := false
	r, ok := b.turn(m, func(ctx context.Context) error {
		saved = true
		return store.Exec(ctx, b.conn, append(b.takePre(), store.Savepoint)...)
	})
	if !ok {
		return
	}
	var rej *pgconn.PgError // the server refused the result
	if r.err == nil && !r.panicked {
		b.complete(m, r.out)
		var err error
		if m.out.Stored.Valid {
			// The server parses the result while the savepoint still holds the effect: a
			// value jsonb refuses rolls back this member alone, not the whole transaction.
			var pre []string
			if !saved {
				saved = true
				pre = append(b.takePre(), store.Savepoint)
			}
			ctx, cancel := b.ctx()
			err = store.CheckResult(ctx, b.conn, pre, m.out.Stored.String)
			cancel()
		}
		switch {
		case err == nil:
			if saved {
				b.pre = append(b.pre, store.Release)
			}
			return
		case !errors.As(err, &rej):
			b.broken = own(err)
			b.reply(m, b.broken)
			return
		}
		m.finish, m.out.Refused = finish{}, rej
	}
	// fn failed: its effect goes with its savepoint.
	if saved {
		ctx, cancel := b.ctx()
		_, err := b.conn.Exec(ctx, store.Undo)
		cancel()
		if err != nil {
			b.broken = own(err)
			b.reply(m, errors.Join(r.err, b.broken))
			return
		}
	}
	switch {
	case r.panicked:
		b.reply(m, nil) // the member panics again
	case rej != nil && rej.Code[:2] == pgcode.DataExceptionClass:
		// A result jsonb refuses is recorded for good, with the commit.
		m.finish = failed(refusedResult+rej.Message, nil)
	case rej != nil:
		b.reply(m, nil)
	case b.e.cfg.Permanent(r.err):
		// Answered with the commit, which records the failure.
		m.finish = failed(r.err.Error(), r.err)
	default:
		b.reply(m, r.err) // no row: the next delivery runs it
	}
}

// turn hands the transaction to m's fn, as a pgx.Tx whose first use runs first (nil:
// none), on this goroutine for a local member, else on m's own, and checks the
// transaction after it. ok is false when m is answered already: its caller ended, or its
// handler broke the transaction (the connection closed or busy, the transaction neither
// open nor aborted), which breaks the batch. A handler that succeeded but left the
// transaction aborted gets that as its error: nothing of it is recorded.
//
// A timed member's time outside the database joins the moving average that decides
// whether deliveries share transactions: on a saturated machine every query takes
// longer, which is when sharing matters most, so the database's time is no reason to
// stop.
func (b *batch) turn(m *member, first func(ctx context.Context) error) (r ran, ok bool) {
	m.finish = finish{}
	if err := m.ctx.Err(); err != nil {
		b.reply(m, fmt.Errorf("idempotency: DoTx %s: %w", m.d.Key, err))
		return r, false
	}
	if b.optimistic {
		b.e.observe(EventSharedRun, m)
	}
	tx := txshim.New(b.conn, first)
	if m.local {
		r = m.runFn(tx)
	} else {
		m.run <- tx
		r = <-m.ran
	}
	if m.timed {
		b.e.handlers.record(r.own)
	}
	b.own += r.own
	pc := b.conn.PgConn()
	st := pc.TxStatus()
	if b.conn.IsClosed() || pc.IsBusy() || st != 'T' && st != 'E' {
		b.broken = fmt.Errorf("idempotency: DoTx %s: the handler ended or broke the transaction (status %q)", m.d.Key, st)
		b.reply(m, errors.Join(r.err, b.broken))
		return r, false
	}
	if r.err == nil && !r.panicked && st != 'T' {
		r.err = fmt.Errorf("idempotency: DoTx %s: the handler ended or broke the transaction (status %q); nothing recorded", m.d.Key, st)
	}
	return r, true
}

// complete has the finish write m's row completed with out, checked (pgtext.Result): the
// result itself, or an error marker in its place.
func (b *batch) complete(m *member, out []byte) {
	m.out.Out = out
	m.out.Stored, m.out.LastErr = pgtext.Result(out, b.e.cfg.MaxResultBytes)
	if m.out.LastErr.Valid {
		b.e.observe(EventBadResult, m)
	}
	m.finish = finish{action: store.ActionComplete}
}

// commit writes every completed or failed member's row in one statement and commits, in
// one round trip; then it answers those members. When the server refuses the finish (a
// row is not what the read found: a conflict, counted; or a result jsonb does not take),
// nothing committed, and the members not answered yet run again, alone, so that each
// outcome is the member's alone. With no row to write, the transaction rolls back.
func (b *batch) commit() {
	var ps []store.FinishParams
	for _, m := range b.claimed {
		if !m.answered && !m.later && m.finish.action != "" {
			ps = append(ps, b.params(m))
		}
	}
	if len(ps) == 0 {
		b.rollback()
		b.answerCommitted(nil)
		return
	}
	ctx, cancel := b.ctx()
	defer cancel()
	err := b.finishAndCommit(ctx, b.takePre(), ps)
	if err != nil && store.Answered(err) {
		if store.Conflict(err) {
			b.e.observe(EventConflict, b.claimed[0])
		}
		b.rollback()
		b.rerunAlone()
		return
	}
	b.answerCommitted(err)
}

// finishAndCommit writes the rows of ps and commits, with the keys' history events the
// ledger has waiting (Config.Events) in the same round trip, after the COMMIT.
func (b *batch) finishAndCommit(ctx context.Context, pre []string, ps []store.FinishParams) error {
	var events []store.EventParams
	if ev := b.e.cfg.Events; ev != nil {
		events = ev.TakeForCommit()
	}
	evErr, err := b.e.cfg.Writes.FinishAndCommit(ctx, b.conn, pre, b.e.lockTimeoutSQL, ps, events)
	if events != nil {
		b.e.cfg.Events.Done(events, err, evErr)
	}
	return err
}

// params are m's row in the finish.
func (b *batch) params(m *member) store.FinishParams {
	d, r, f := &m.d, &m.out.Row, m.finish
	p := store.FinishParams{Key: d.Key, Fence: r.Fence.Int64, Owner: m.out.Owner, Action: f.action, Result: m.out.Stored, Error: m.out.LastErr,
		IntentSum: d.IntentSum, TaskType: d.TaskType, Fingerprint: d.Fingerprint, Attempt: int(r.Attempts.Int32), Generation: int(r.Generation.Int32), TraceID: d.TraceID,
		Found: r.Status.Valid}
	if f.action == store.ActionFail {
		p.Result, p.Error = pgtype.Text{}, f.errMsg
	}
	return p
}

// answerCommitted answers the claimed members after the COMMIT, whose error is err. An
// error on a connection still open means nothing committed: the batch is broken. A
// COMMIT whose answer was lost is resolved by each member with the transaction id drawn
// with the claims.
func (b *batch) answerCommitted(err error) {
	if err != nil && (store.Answered(err) || !b.conn.IsClosed() || b.xid == "") {
		b.broken = own(err)
		return
	}
	for _, m := range b.claimed {
		m.out.XID, m.out.ServerStart = b.xid, b.serverStart
		switch {
		case m.answered:
		case m.later:
			// It did not run: it runs alone now, whatever the commit's fate.
			b.again(m, false)
		case err != nil: // the answer was lost: each member resolves it by transaction id
			m.out.Lost, m.out.Recorded = err, m.finish.action == store.ActionFail
			b.reply(m, m.finish.err)
		case m.finish.action == store.ActionFail:
			b.e.observe(EventFailed, m)
			m.out.Recorded = true
			b.reply(m, m.finish.err)
		default:
			b.e.observe(EventCompleted, m)
			b.reply(m, nil)
		}
	}
}

// rerunAlone answers every member of an undone transaction that is not answered yet: it
// runs in a transaction of its own; and shared transactions give their members
// savepoints for a while.
func (b *batch) rerunAlone() {
	b.e.SavepointsUntil(time.Now().Add(SavepointsFor))
	for _, m := range b.claimed {
		if !m.answered {
			b.e.observe(EventSharedRerun, m)
		}
		b.again(m, false)
	}
}

// reply answers m, once, with its outcome so far and err.
func (b *batch) reply(m *member, err error) {
	if m.answered {
		return
	}
	m.answered = true
	m.out.Err = err
	m.answer <- m.out
}

// ctx bounds one round trip of the executor: a claim's lock wait and a write.
func (b *batch) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), b.e.cfg.WriteTimeout+b.e.cfg.ClaimLockTimeout)
}

func (b *batch) takePre() []string {
	p := b.pre
	b.pre = nil
	return p
}

// rollback ends the transaction (or closes the connection).
func (b *batch) rollback() {
	ctx, cancel := b.ctx()
	defer cancel()
	store.Rollback(ctx, b.conn)
}

// batchSpan starts, when two or more of ms are traced, the span of the transaction they
// share, "idemq.shared_tx" (see sharedspan).
func (e *Exec) batchSpan(ms []*member) trace.Span {
	if e.cfg.Tracer == nil || len(ms) < 2 {
		return nil
	}
	var traced sharedspan.Members
	for _, m := range ms {
		traced.Add(trace.SpanFromContext(m.ctx))
	}
	return sharedspan.Start(e.cfg.Tracer, "idemq.shared_tx", len(ms), traced)
}

func (e *Exec) acquire() (*pgxpool.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), e.cfg.WriteTimeout)
	defer cancel()
	return e.cfg.Pool.Acquire(ctx)
}

func (e *Exec) observe(ev string, m *member) {
	if e.cfg.Observe != nil {
		e.cfg.Observe(ev, m.d.TaskType)
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

// member is one delivery in a transaction: shared (it waits in Exec.q and its own
// goroutine runs fn when the executor hands it the transaction) or local (alone: the
// caller's goroutine is the executor and runs fn itself). It carries its caller's ctx,
// as an http.Request does, so that the executor can tell at the member's turn whether the
// caller still waits.
type member struct {
	ctx   context.Context
	d     Delivery
	local bool
	round int // claim rounds before this one
	// timed: fn's run time joins the moving average (Exec.handlers). Shared members and
	// deliveries run alone because handlers are slow are timed, so that the average can
	// come down again; a member given back by a shared transaction (past its budget, or
	// after a lost race) is not: its run alone says nothing of how sharing goes.
	timed bool
	scope string // its scope's line, when it waits in one (Exec.scoped)

	run    chan *txshim.Tx // executor → member: the claim is taken, run fn
	ran    chan ran        // member → executor: fn returned or panicked
	answer chan Outcome    // executor → member: the outcome (buffered)

	// The executor's own.
	out      Outcome // the outcome so far, of this claim round
	answered bool
	requeue  bool // back to the head of its scope's line after the batch (batch.again)
	finish   finish
	later    bool // did not run in the batch (past Budget): runs alone after it
	panicked bool // fn panicked with pval: the caller panics again
	pval     any
}

// newMember returns the member of a delivery, local or shared (the hand-over channels
// carry its turn).
func newMember(ctx context.Context, d Delivery, local bool) *member {
	m := &member{ctx: ctx, d: d, local: local, answer: make(chan Outcome, 1)}
	if !local {
		m.run, m.ran = make(chan *txshim.Tx, 1), make(chan ran, 1)
	}
	return m
}

type ran struct {
	out      json.RawMessage
	err      error
	panicked bool
	own      time.Duration // fn's run less what it waited on the database
}

// finish is what the finish writes for a claimed member: its row completed with its
// result, or failed (permanent); none (action "") when its handler failed otherwise.
type finish struct {
	action store.Action // complete or fail
	errMsg pgtype.Text
	err    error // the handler's error, answered after the commit (fail)
}

// refusedResult begins the recorded error of a result jsonb refuses.
const refusedResult = "idempotency: result refused by the database: "

// failed is the finish that records a permanent failure, msg (cleaned) as its last error;
// err is answered after the commit.
func failed(msg string, err error) finish {
	return finish{action: store.ActionFail, errMsg: pgtype.Text{String: pgtext.Clean(msg), Valid: true}, err: err}
}

// runFn runs m's fn on tx, in ctx carrying the claim, recovering a panic (its value is
// m.pval).
func (m *member) runFn(tx *txshim.Tx) (r ran) {
	began := time.Now()
	defer func() {
		r.own = time.Since(began) - tx.InDB()
		if p := recover(); p != nil {
			r.panicked, m.panicked, m.pval = true, true, p
		}
	}()
	r.out, r.err = m.d.Fn(claimctx.WithTx(m.ctx, m.d.Key, m.out.Row.Fence.Int64), tx)
	return r
}
