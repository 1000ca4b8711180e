package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/internal/pgcode"
)

// The statements that frame a shared DoTx transaction. Each member runs in a savepoint of
// its own, released when it succeeds and rolled back when it does not; one name serves
// all, as the previous member's savepoint is gone before the next one is made.
const (
	txBatchBeginSQL    = "BEGIN ISOLATION LEVEL READ COMMITTED"
	savepointMemberSQL = "SAVEPOINT idemq_member"
	releaseMemberSQL   = "RELEASE SAVEPOINT idemq_member"
	rollbackMemberSQL  = "ROLLBACK TO SAVEPOINT idemq_member"
	// undoMemberSQL runs alone, in the simple protocol, which an aborted transaction accepts.
	undoMemberSQL = rollbackMemberSQL + "; " + releaseMemberSQL
)

// txBatchBudget is how long a shared transaction runs its members' handlers: the members
// still waiting when it is spent give their claims back (in the finish) and run in
// transactions of their own, in parallel. Sharing pays when handlers take about as long
// as a claim and a commit; a handler that sleeps or waits on a slow query would otherwise
// hold up every member after it.
const txBatchBudget = 5 * time.Millisecond

// txSlowHandler is the average handler time above which DoTx deliveries stop sharing
// transactions and run alone, in parallel, until handlers are quick again.
const txSlowHandler = time.Millisecond

// txBatcher runs concurrent DoTx deliveries in shared transactions: one multi-row claim,
// a savepoint per delivery, one multi-row finish and the COMMIT. Deliveries queue up; up to Config.Committers executors each take what is queued (at
// most Config.MaxBatch, one delivery per key) when they start a transaction, so at low
// load a transaction carries one delivery and waits for nothing.
type txBatcher struct {
	// handlerNanos is a moving average of how long DoTx handlers take, shared or alone:
	// above Ledger.txSlow, deliveries run alone instead of queueing.
	handlerNanos atomic.Int64

	mu       sync.Mutex
	queue    []*txMember
	inFlight map[string]bool // keys of members taken by a running batch
	running  int             // executors running
}

// txMember is one DoTx delivery waiting in, or running in, a shared transaction. It
// carries its caller's ctx, as an http.Request does, so that the executor can tell at the
// member's turn whether the caller still waits.
type txMember struct {
	ctx context.Context
	req Request

	run    chan txTurn   // executor → member: the claim is taken, run fn
	ran    chan txRan    // member → executor: fn returned or panicked
	answer chan txAnswer // executor → member: the outcome

	// Guarded by txBatcher.mu.
	taken bool

	// The executor's own.
	answered bool
	claim    *Claim
	res      Result
	finish   txFinish
	later    bool // did not run in the batch (past txBatchBudget): runs alone after it
}

type txTurn struct {
	tx *handlerTx
	c  *Claim
}

type txRan struct {
	out      json.RawMessage
	err      error
	panicked bool
}

type txAnswer struct {
	res   Result
	err   error
	stuck int64 // a fence to mark needs_attention
	lost  error // the commit's answer was lost: resolve it from the transaction id
	// alone: the shared claim could not decide this member (a lost race, or a batch the
	// server refused): it runs in a transaction of its own instead.
	alone bool
	// recorded: a permanent failure was committed with the batch (no recordPermanent).
	recorded bool
}

// doTxBatched is DoTx in a transaction shared with concurrent deliveries.
func (l *Ledger) doTxBatched(ctx context.Context, req Request, fn func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error)) (Result, error) {
	if l.txb.slow(l) {
		// Handlers this slow gain nothing from sharing a connection: alone, side by side.
		return l.doTxAlone(ctx, req, l.txb.timed(fn))
	}
	m := &txMember{ctx: ctx, req: req, run: make(chan txTurn, 1), ran: make(chan txRan, 1), answer: make(chan txAnswer, 1)}
	l.txb.enqueue(l, m)
	done := ctx.Done()
	for {
		select {
		case <-done:
			if l.txb.leave(m) {
				return Result{}, fmt.Errorf("idempotency: claim %s: %w", req.Key, ctx.Err())
			}
			done = nil // taken: the executor answers, at the latest when its turn comes
		case t := <-m.run:
			out, err, panicked, pval := runTxFn(withClaim(ctx, t.c.Key, t.c.Fence), t.tx, fn)
			m.ran <- txRan{out: out, err: err, panicked: panicked}
			if panicked {
				<-m.answer // rolled back to the member's savepoint
				panic(pval)
			}
		case a := <-m.answer:
			if a.alone {
				return l.doTxAlone(ctx, req, fn)
			}
			if a.stuck != 0 {
				l.markStuckOne(ctx, req, a.stuck)
			}
			if a.lost != nil {
				rctx := ctx
				if ctx.Err() != nil {
					var cancel context.CancelFunc
					rctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
					defer cancel()
				}
				if err := l.commitLost(rctx, m.claim, a.lost); err != nil {
					return Result{}, err
				}
				l.observe(EventCompleted, req.TaskType)
			}
			if IsPermanent(a.err) && !a.recorded {
				l.recordPermanent(ctx, req, a.err)
			}
			return a.res, a.err
		}
	}
}

// record adds a handler's run time to the moving average (weight 1/8).
func (b *txBatcher) record(d time.Duration) {
	for {
		old := b.handlerNanos.Load()
		if b.handlerNanos.CompareAndSwap(old, old+(int64(d)-old)/8) {
			return
		}
	}
}

// slow reports whether handlers take too long to share transactions.
func (b *txBatcher) slow(l *Ledger) bool { return time.Duration(b.handlerNanos.Load()) > l.txSlow }

// timed wraps fn so that its run time joins the moving average.
func (b *txBatcher) timed(fn func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error)) func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
	return func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		start := time.Now()
		defer func() { b.record(time.Since(start)) }()
		return fn(ctx, tx)
	}
}

// enqueue queues m and starts an executor if fewer than Config.Committers run.
func (b *txBatcher) enqueue(l *Ledger, m *txMember) {
	b.mu.Lock()
	b.queue = append(b.queue, m)
	start := b.running < l.cfg.Committers
	if start {
		b.running++
	}
	b.mu.Unlock()
	if start {
		go l.runTxBatches()
	}
}

// leave takes m out of the queue, unless an executor took it already.
func (b *txBatcher) leave(m *txMember) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if m.taken {
		return false
	}
	b.queue = slices.DeleteFunc(b.queue, func(q *txMember) bool { return q == m })
	return true
}

// ready reports whether a member could be taken now.
func (b *txBatcher) ready() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, m := range b.queue {
		if !b.inFlight[m.req.Key] {
			return true
		}
	}
	return false
}

// take takes up to n queued members for a batch, one per key and none whose key a running
// batch holds, in key order. When there is none, the executor calling it ends.
func (b *txBatcher) take(n int) []*txMember {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.inFlight == nil {
		b.inFlight = map[string]bool{}
	}
	var ms []*txMember
	rest := b.queue[:0]
	for _, m := range b.queue {
		if len(ms) < n && !b.inFlight[m.req.Key] {
			b.inFlight[m.req.Key] = true
			m.taken = true
			ms = append(ms, m)
			continue
		}
		rest = append(rest, m)
	}
	clear(b.queue[len(rest):])
	b.queue = rest
	if len(ms) == 0 {
		b.running--
		return nil
	}
	slices.SortFunc(ms, func(a, b *txMember) int { return strings.Compare(a.req.Key, b.req.Key) })
	return ms
}

// finish frees the keys of a batch whose members are all answered.
func (b *txBatcher) finish(ms []*txMember) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, m := range ms {
		delete(b.inFlight, m.req.Key)
	}
}

// runTxBatches is an executor: it runs batches on one connection until nothing is queued.
func (l *Ledger) runTxBatches() {
	var conn *pgxpool.Conn
	defer func() {
		if conn != nil {
			conn.Release()
		}
	}()
	for {
		// Take the connection first, so that members stay free to leave meanwhile.
		var acqErr error
		if conn == nil && l.txb.ready() {
			conn, acqErr = l.acquireTxConn()
		}
		ms := l.txb.take(l.cfg.MaxBatch)
		if ms == nil {
			return
		}
		if conn == nil && acqErr == nil {
			conn, acqErr = l.acquireTxConn()
		}
		if acqErr != nil {
			for _, m := range ms {
				m.answer <- txAnswer{err: fmt.Errorf("idempotency: claim %s: %w", m.req.Key, acqErr)}
			}
			l.txb.finish(ms)
			continue
		}
		l.observeBatch(BatchTx, len(ms))
		if !l.runTxBatch(conn.Conn(), ms) {
			conn.Release() // the pool closes a connection left in a transaction
			conn = nil
		}
		l.txb.finish(ms)
	}
}

func (l *Ledger) acquireTxConn() (*pgxpool.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.WriteTimeout)
	defer cancel()
	return l.pool.Acquire(ctx)
}

// txBatch is the state of one shared transaction, used by its executor only: one
// multi-row claim for every member (claimManySQL), each claimed member's handler in a
// savepoint of its own (made when the handler first uses the transaction), one multi-row
// finish (finishManySQL) that completes, fails or forgets every claimed row, and one
// COMMIT. The claim and the finish cost one statement each, whatever the batch's size.
type txBatch struct {
	l    *Ledger
	conn *pgx.Conn
	idle string // idle_in_transaction_session_timeout for the whole transaction

	xid, serverStart string // the transaction's id, drawn with the claims

	pre     []string    // statements sent ahead of the next round trip (a RELEASE)
	claimed []*txMember // members whose rows the finish ends, in order
	broken  error       // the transaction cannot commit
}

// ctx bounds one round trip of the executor: a claim's lock wait and a write.
func (b *txBatch) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), b.l.cfg.WriteTimeout+b.l.cfg.ClaimLockTimeout)
}

func (b *txBatch) replyWith(m *txMember, a txAnswer) {
	if m.answered {
		return
	}
	m.answered = true
	m.answer <- a
}

// runTxBatch runs ms, sorted by key, in one transaction on conn, and answers each. It
// reports whether conn is fit for another batch.
func (l *Ledger) runTxBatch(conn *pgx.Conn, ms []*txMember) bool {
	// The transaction lives across its members: its idle timeout is the longest any
	// member allows, so no member's short deadline cuts the others off.
	var latest time.Time
	for _, m := range ms {
		if m.req.Deadline.IsZero() {
			latest = time.Time{}
			break
		}
		if m.req.Deadline.After(latest) {
			latest = m.req.Deadline
		}
	}
	b := &txBatch{l: l, conn: conn, idle: l.idleTimeout(latest)}
	if b.claimAll(ms) {
		start := time.Now()
		for _, m := range b.claimed {
			if b.broken != nil {
				break
			}
			if time.Since(start) > l.txBudget {
				// Handlers this slow gain nothing from sharing a connection: the rest
				// give their claims back and run alone, side by side.
				m.finish, m.later = txFinish{action: "forget"}, true
				continue
			}
			b.runMember(m)
		}
		if b.broken == nil {
			b.commit()
		}
	}
	if b.broken != nil {
		for _, m := range ms {
			b.replyWith(m, txAnswer{err: fmt.Errorf("idempotency: DoTx %s: the shared transaction did not commit; nothing recorded: %w", m.req.Key, b.broken)})
		}
		if conn.PgConn().TxStatus() != 'I' && !conn.IsClosed() {
			ctx, cancel := b.ctx()
			if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
				conn.PgConn().Close(ctx)
			}
			cancel()
		}
	}
	return !conn.IsClosed() && conn.PgConn().TxStatus() == 'I'
}

// claimAll begins the transaction and claims every member's key in one statement. A
// member that is not claimed is answered at once (a completed key's result is committed
// data). When the server refuses the statement (a lock wait cut short, say), every member
// runs alone instead. It reports whether any member was claimed.
func (b *txBatch) claimAll(ms []*txMember) bool {
	l := b.l
	var ops []*gcOp
	var live []*txMember
	for _, m := range ms {
		if err := m.ctx.Err(); err != nil {
			b.replyWith(m, txAnswer{err: fmt.Errorf("idempotency: claim %s: %w", m.req.Key, err)})
			continue
		}
		c, args, err := l.newClaim(m.req, false)
		if err != nil {
			b.replyWith(m, txAnswer{err: err})
			continue
		}
		m.claim = c
		a := &claimArgs{taskType: m.req.TaskType, owner: c.owner, leaseUS: args[4].(int64)}
		if fp, ok := args[3].([]byte); ok {
			a.fp = fp
		}
		ops, live = append(ops, &gcOp{key: m.req.Key, row: a}), append(live, m)
	}
	if len(live) == 0 {
		return false
	}
	ctx, cancel := b.ctx()
	defer cancel()
	batch := &pgx.Batch{}
	batch.Queue(txBatchBeginSQL)
	batch.Queue("SELECT set_config('idle_in_transaction_session_timeout', $1, true), pg_current_xact_id()::text, pg_postmaster_start_time()::text", b.idle)
	args := l.claimManyArgs(ops)
	args[6] = true // written completed: the row lock is the lease until the COMMIT
	batch.Queue(claimSettingsSQL, l.lockTimeoutSQL)
	batch.Queue(claimManySQL, args...)
	batch.Queue(restoreClaimSettingsSQL)
	br := b.conn.SendBatch(ctx, batch)
	rows := make([]claimRow, len(live))
	answered := make([]bool, len(live))
	_, err := br.Exec()
	if err == nil {
		// The transaction id, drawn now, resolves a COMMIT whose answer is lost.
		err = br.QueryRow().Scan(nil, &b.xid, &b.serverStart)
	}
	if err == nil { // the planner settings and the lock timeout
		_, err = br.Exec()
	}
	if err == nil {
		var rs pgx.Rows
		rs, err = br.Query()
		for err == nil && rs.Next() {
			var ord int
			var r claimRow
			if err = rs.Scan(r.targets(&ord)...); err == nil && (ord < 1 || ord > len(live)) {
				err = fmt.Errorf("answer for row %d of %d", ord, len(live))
			}
			if err == nil {
				rows[ord-1], answered[ord-1] = r, true
			}
		}
		if rs != nil {
			rs.Close()
			if err == nil {
				err = rs.Err()
			}
		}
	}
	if err == nil { // the settings put back
		_, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) {
			b.broken = err
			return false
		}
		// Refused (a lock timeout, a constraint): nothing was claimed. Each member runs
		// in a transaction of its own, which tells it what happened to its key.
		for _, m := range live {
			b.replyWith(m, txAnswer{alone: true})
		}
		rctx, rcancel := b.ctx()
		defer rcancel()
		if _, err := b.conn.Exec(rctx, "ROLLBACK"); err != nil {
			b.broken = err
		}
		return false
	}
	for i, m := range live {
		r := &rows[i]
		if !answered[i] || !r.claimed && r.attempted {
			b.replyWith(m, txAnswer{alone: true}) // a lost race: look again alone
			continue
		}
		cr, stuck, again, err := l.decide(m.req, m.claim, r, 0)
		switch {
		case again:
			b.replyWith(m, txAnswer{alone: true})
		case cr.Claim != nil:
			b.claimed = append(b.claimed, m)
		default:
			a := txAnswer{err: err, stuck: stuck}
			if cr.Completed != nil {
				a.res = *cr.Completed
			}
			b.replyWith(m, a)
		}
	}
	return len(b.claimed) > 0
}

// finish is what the shared finish does with a claimed member's row.
type txFinish struct {
	action string // complete, fail (permanent) or forget (the handler failed)
	errMsg pgtype.Text
	err    error // the handler's error, answered after the commit (fail)
}

// runMember has m's goroutine run fn on the shared transaction. The member's savepoint is
// made when fn first uses the transaction; it is released when fn succeeds (after the
// database accepted its result as jsonb) and rolled back when fn fails.
func (b *txBatch) runMember(m *txMember) {
	c := m.claim
	m.finish = txFinish{action: "forget"}
	if err := m.ctx.Err(); err != nil {
		b.replyWith(m, txAnswer{err: fmt.Errorf("idempotency: DoTx %s: %w", c.Key, err)})
		return
	}
	saved := false
	tx := &handlerTx{conn: b.conn, first: func(ctx context.Context) error {
		saved = true
		return b.exec(ctx, append(b.takePre(), savepointMemberSQL)...)
	}}
	began := time.Now()
	m.run <- txTurn{tx: tx, c: c}
	ran := <-m.ran
	b.l.txb.record(time.Since(began))
	pc := b.conn.PgConn()
	st := pc.TxStatus()
	if b.conn.IsClosed() || pc.IsBusy() || st != 'T' && st != 'E' {
		b.broken = fmt.Errorf("idempotency: DoTx %s: the handler ended or broke the shared transaction (status %q)", c.Key, st)
		b.replyWith(m, txAnswer{err: errors.Join(ran.err, b.broken)})
		return
	}
	if ran.err == nil && !ran.panicked && st != 'T' {
		ran.err = fmt.Errorf("idempotency: DoTx %s: the handler ended or broke the transaction (status %q); nothing recorded", c.Key, st)
	}
	if ran.err == nil && !ran.panicked {
		stored, lastErr := b.l.checkResult(c, ran.out)
		var stmts []string
		var args []any
		if stored != nil || lastErr != nil {
			// The result is stored, fenced, while the savepoint still holds the effect: a
			// row taken meanwhile, or a value jsonb refuses, rolls back this member alone.
			if !saved {
				saved = true
				stmts = append(b.takePre(), savepointMemberSQL)
			}
			stmts, args = append(stmts, b.l.sql.storeResultTx), []any{c.Key, c.Fence, c.owner, stored, lastErr}
		}
		err := b.check(stmts, args)
		var pgErr *pgconn.PgError
		switch {
		case err == nil:
			if saved {
				b.pre = append(b.pre, releaseMemberSQL)
			}
			m.finish = txFinish{action: "complete"}
			m.res = Result{Key: c.Key, Result: storedForm(ran.out, b.l.cfg.MaxResultBytes), Fence: c.Fence, Attempts: c.Attempt, Generation: c.Generation}
			return
		case !errors.As(err, &pgErr):
			b.broken = err
			b.replyWith(m, txAnswer{err: err})
			return
		case pgErr.Code == pgcode.DivisionByZero:
			b.l.leaseLost(c, "completion")
			ran.err = fmt.Errorf("%w: key %q fence %d", ErrLeaseLost, c.Key, c.Fence)
		case pgErr.Code[:2] == "22":
			// The database refused the result (a data exception): the savepoint takes
			// fn's effect with it; record that for good.
			ran.err = Permanent(fmt.Errorf("idempotency: result refused by the database: %s", pgErr.Message))
		default:
			ran.err = fmt.Errorf("idempotency: complete %s: %w", c.Key, err)
		}
	}
	// fn failed: its effect goes with its savepoint; its claim is ended by the finish.
	if saved {
		ctx, cancel := b.ctx()
		_, err := b.conn.Exec(ctx, undoMemberSQL)
		cancel()
		if err != nil {
			b.broken = err
			b.replyWith(m, txAnswer{err: errors.Join(ran.err, err)})
			return
		}
	}
	if ran.panicked {
		b.replyWith(m, txAnswer{}) // the member panics again
		return
	}
	if IsPermanent(ran.err) {
		m.finish = txFinish{action: "fail", errMsg: text(cleanText(ran.err.Error())), err: ran.err}
		return // answered with the commit, which records the failure
	}
	b.replyWith(m, txAnswer{err: ran.err})
}

func text(v any) pgtype.Text {
	s, ok := v.(string)
	return pgtype.Text{String: s, Valid: ok}
}

func (b *txBatch) takePre() []string {
	p := b.pre
	b.pre = nil
	return p
}

// exec runs plain statements in one round trip.
func (b *txBatch) exec(ctx context.Context, stmts ...string) error {
	if len(stmts) == 0 {
		return nil
	}
	batch := &pgx.Batch{}
	for _, s := range stmts {
		batch.Queue(s)
	}
	return b.conn.SendBatch(ctx, batch).Close()
}

// check runs stmts, the last with args, in one round trip.
func (b *txBatch) check(stmts []string, args []any) error {
	if len(stmts) == 0 {
		return nil
	}
	ctx, cancel := b.ctx()
	defer cancel()
	batch := &pgx.Batch{}
	for i, s := range stmts {
		if i == len(stmts)-1 {
			batch.Queue(s, args...)
		} else {
			batch.Queue(s)
		}
	}
	return b.conn.SendBatch(ctx, batch).Close()
}

// commit ends every claimed row in one statement (completed, failed, or forgotten: the
// row a failed handler's claim inserted is deleted, a taken-over one ends its lease) and
// commits, in one round trip; then it answers the members whose rows it completed or
// failed. A COMMIT whose answer is lost is resolved with the transaction id drawn with
// the claims.
func (b *txBatch) commit() {
	l := b.l
	n := len(b.claimed)
	keys, fences, owners := make([]string, n), make([]int64, n), make([]pgtype.UUID, n)
	actions, errs := make([]string, n), make([]pgtype.Text, n)
	for i, m := range b.claimed {
		keys[i], fences[i], owners[i], actions[i], errs[i] = m.req.Key, m.claim.Fence, m.claim.owner, m.finish.action, m.finish.errMsg
		m.claim.xid, m.claim.serverStart = b.xid, b.serverStart
	}
	ctx, cancel := b.ctx()
	defer cancel()
	batch := &pgx.Batch{}
	for _, s := range b.takePre() {
		batch.Queue(s)
	}
	batch.Queue(keyPlansSQL)
	batch.Queue(l.sql.finishTxMany, keys, fences, owners, actions, errs)
	batch.Queue("COMMIT")
	br := b.conn.SendBatch(ctx, batch)
	var err error
	for range batch.Len() - 2 {
		if _, err = br.Exec(); err != nil {
			break
		}
	}
	if err == nil {
		// The finish's rows (every one checked by the statement itself).
		_, err = br.Exec()
	}
	if err == nil {
		var tag pgconn.CommandTag
		tag, err = br.Exec()
		if err == nil && tag.String() != "COMMIT" {
			err = fmt.Errorf("commit answered %q", tag.String()) // an aborted transaction answers ROLLBACK
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	var pgErr *pgconn.PgError
	if err != nil && (errors.As(err, &pgErr) || !b.conn.IsClosed() || b.xid == "") {
		b.broken = err // answered: nothing committed
		return
	}
	for _, m := range b.claimed {
		switch {
		case m.later:
			// Its claim is gone (forgotten by the commit, or never committed if the lost
			// answer was a failure): it runs alone now. It must be answered whatever the
			// commit's fate: it waits for nothing else.
			b.replyWith(m, txAnswer{alone: true})
		case m.finish.action == "forget":
		case err != nil: // the answer was lost: each member resolves it by transaction id
			b.replyWith(m, txAnswer{res: m.res, err: m.finish.err, lost: err, recorded: m.finish.err != nil})
		case m.finish.action == "fail":
			l.observe(EventFailed, m.req.TaskType)
			b.replyWith(m, txAnswer{err: m.finish.err, recorded: true})
		default:
			l.observe(EventCompleted, m.req.TaskType)
			b.replyWith(m, txAnswer{res: m.res})
		}
	}
}
