package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
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

// txBatcher runs concurrent DoTx deliveries in shared transactions, one savepoint each.
// Deliveries queue up; up to Config.Committers executors each take what is queued (at
// most Config.MaxBatch, one delivery per key) when they start a transaction, so at low
// load a transaction carries one delivery and waits for nothing.
type txBatcher struct {
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
}

// doTxBatched is DoTx in a transaction shared with concurrent deliveries.
func (l *Ledger) doTxBatched(ctx context.Context, req Request, fn func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error)) (Result, error) {
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
			if IsPermanent(a.err) {
				l.recordPermanent(ctx, req, a.err)
			}
			return a.res, a.err
		}
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

// txStmt is one statement of a pipelined round trip.
type txStmt struct {
	sql   string
	args  []any
	kind  stmtKind
	owner *txMember // store: the member whose result it stores; release: the member it completes
}

type stmtKind int

const (
	stmtPlain stmtKind = iota
	stmtClaim
	stmtStore
	stmtRelease
	stmtCommit
)

// txBatch is the state of one shared transaction, used by its executor only.
type txBatch struct {
	l    *Ledger
	conn *pgx.Conn
	ms   []*txMember
	idle string // idle_in_transaction_session_timeout for the whole transaction

	pre    []txStmt    // sent ahead of the next statements
	stored []*txMember // members whose result and release went through, awaiting COMMIT
	broken error       // the transaction cannot commit
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
	b := &txBatch{l: l, conn: conn, ms: ms, idle: l.idleTimeout(latest)}
	b.pre = []txStmt{{sql: txBatchBeginSQL}}
	for _, m := range ms {
		if b.broken != nil {
			break
		}
		b.runMember(m)
	}
	if b.broken == nil {
		b.commit()
	}
	if b.broken != nil {
		for _, m := range ms {
			b.reply(m, Result{}, fmt.Errorf("idempotency: DoTx %s: the shared transaction did not commit; nothing recorded: %w", m.req.Key, b.broken))
		}
		return false
	}
	return conn.PgConn().TxStatus() == 'I'
}

func (b *txBatch) reply(m *txMember, res Result, err error) {
	b.replyWith(m, txAnswer{res: res, err: err})
}

func (b *txBatch) replyWith(m *txMember, a txAnswer) {
	if m.answered {
		return
	}
	m.answered = true
	m.answer <- a
}

// ctx bounds one round trip of the executor: a claim's lock wait and a write.
func (b *txBatch) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), b.l.cfg.WriteTimeout+b.l.cfg.ClaimLockTimeout)
}

// send sends b.pre and then next in one round trip. It returns the index in the sent
// statements of the first one that failed and its error; the server skipped those after
// it. A claim's row lands in r. Members whose release went through join b.stored.
func (b *txBatch) send(next []txStmt, r *claimRow) ([]txStmt, int, pgconn.CommandTag, error) {
	stmts := append(b.pre, next...)
	b.pre = nil
	ctx, cancel := b.ctx()
	defer cancel()
	batch := &pgx.Batch{}
	for _, s := range stmts {
		batch.Queue(s.sql, s.args...)
	}
	br := b.conn.SendBatch(ctx, batch)
	failed, tag := -1, pgconn.CommandTag{}
	var err error
	for i, s := range stmts {
		if s.kind == stmtClaim {
			err = r.scan(br.QueryRow())
		} else {
			tag, err = br.Exec()
		}
		if err != nil {
			failed = i
			break
		}
		if s.kind == stmtRelease {
			b.stored = append(b.stored, s.owner)
		}
	}
	if cerr := br.Close(); err == nil && cerr != nil {
		failed, err = len(stmts)-1, cerr
	}
	return stmts, failed, tag, err
}

// undo rolls the current member's savepoint back and releases it, at once: the
// transaction may be aborted. It breaks the batch if that fails.
func (b *txBatch) undo() bool {
	ctx, cancel := b.ctx()
	defer cancel()
	if _, err := b.conn.Exec(ctx, undoMemberSQL); err != nil {
		b.broken = err
		return false
	}
	return true
}

// storeFailed answers the member whose result store failed, as doTxOnce does, and rolls
// its savepoint back.
func (b *txBatch) storeFailed(m *txMember, err error) {
	c := m.claim
	var pgErr *pgconn.PgError
	errors.As(err, &pgErr)
	switch {
	case pgErr.Code == "22012":
		b.l.leaseLost(c, "completion")
		err = fmt.Errorf("%w: key %q fence %d", ErrLeaseLost, c.Key, c.Fence)
	case pgErr.Code[:2] == "22":
		// The database refused the result after all (a data exception): the savepoint
		// takes fn's effect with it; record that for good.
		err = Permanent(fmt.Errorf("idempotency: result refused by the database: %s", pgErr.Message))
	default:
		err = fmt.Errorf("idempotency: complete %s: %w", c.Key, err)
	}
	if b.undo() {
		b.reply(m, Result{}, err)
	}
}

// sendFailed handles a failed round trip: a store that failed costs its member only; any
// other failure but a claim's breaks the batch. It reports whether the statement that
// failed was the claim (of the current member).
func (b *txBatch) sendFailed(stmts []txStmt, failed int, err error) (claimFailed bool) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || failed < 0 {
		b.broken = err
		return false
	}
	switch s := stmts[failed]; s.kind {
	case stmtStore:
		b.storeFailed(s.owner, err)
	case stmtClaim:
		return true
	default:
		b.broken = err
	}
	return false
}

// runMember claims m's key in a savepoint and, when claimed, has m run fn; it answers m
// unless m's write awaits the COMMIT.
func (b *txBatch) runMember(m *txMember) {
	l, req := b.l, m.req
	if err := m.ctx.Err(); err != nil {
		b.reply(m, Result{}, fmt.Errorf("idempotency: claim %s: %w", req.Key, err))
		return
	}
	inSavepoint := false
	for round := 0; ; round++ {
		c, args, err := l.newClaim(req, true)
		if err != nil {
			if inSavepoint {
				b.pre = append(b.pre, txStmt{sql: rollbackMemberSQL}, txStmt{sql: releaseMemberSQL})
			}
			b.reply(m, Result{}, err)
			return
		}
		args[8] = b.idle
		var next []txStmt
		if !inSavepoint {
			next = append(next, txStmt{sql: savepointMemberSQL})
		}
		next = append(next, txStmt{sql: claimSQL, args: args, kind: stmtClaim})
		var r claimRow
		stmts, failed, _, err := b.send(next, &r)
		if err != nil {
			if !b.sendFailed(stmts, failed, err) {
				if b.broken != nil {
					return
				}
				round-- // the previous member's store failed; this claim was not run
				continue
			}
			// The claim failed (a lock or serialization failure is busy): only this member.
			if b.undo() {
				b.reply(m, Result{}, l.claimError(req, err))
			}
			return
		}
		inSavepoint = true
		if !r.claimed && r.attempted {
			// Lost a race with a concurrent change: look again, past the claim's snapshot.
			ctx, cancel := b.ctx()
			err := r.scan(b.conn.QueryRow(ctx, readRowSQL, req.Key))
			cancel()
			if errors.Is(err, pgx.ErrNoRows) {
				r = claimRow{} // deleted meanwhile: decide counts it as a race
			} else if err != nil {
				var pgErr *pgconn.PgError
				if !errors.As(err, &pgErr) {
					b.broken = err
				} else if b.undo() {
					b.reply(m, Result{}, l.claimError(req, err))
				}
				return
			}
		}
		cr, stuck, again, err := l.decide(req, c, &r, round)
		if again {
			b.pre = append(b.pre, txStmt{sql: rollbackMemberSQL})
			continue
		}
		if cr.Claim == nil {
			// Nothing was written; the rollback frees any row lock the claim took.
			b.pre = append(b.pre, txStmt{sql: rollbackMemberSQL}, txStmt{sql: releaseMemberSQL})
			a := txAnswer{err: err, stuck: stuck}
			if cr.Completed != nil {
				a.res = *cr.Completed // committed data: no need to wait for this transaction
			}
			b.replyWith(m, a)
			return
		}
		m.claim = c
		b.runFn(m, c)
		return
	}
}

// runFn has m's goroutine run fn on the shared transaction, then queues the result's
// store and the savepoint's release, or rolls the savepoint back.
func (b *txBatch) runFn(m *txMember, c *Claim) {
	m.run <- txTurn{tx: &handlerTx{conn: b.conn}, c: c}
	ran := <-m.ran
	pc := b.conn.PgConn()
	st := pc.TxStatus()
	if ran.panicked {
		if b.undo() {
			b.reply(m, Result{}, nil) // the member panics again
		}
		return
	}
	if ran.err == nil && st != 'T' {
		ran.err = fmt.Errorf("idempotency: DoTx %s: the handler ended or broke the transaction (status %q); nothing recorded", c.Key, st)
	}
	if ran.err != nil {
		if st != 'T' && st != 'E' || b.conn.IsClosed() || pc.IsBusy() {
			// The shared transaction is gone (or its connection unusable).
			b.reply(m, Result{}, ran.err)
			b.broken = ran.err
			return
		}
		if b.undo() {
			b.reply(m, Result{}, ran.err)
		}
		return
	}
	stored, lastErr := b.l.checkResult(c, ran.out)
	if stored != nil || lastErr != nil {
		b.pre = append(b.pre, txStmt{sql: b.l.fenced(storeResultTxSQL), args: []any{c.Key, c.Fence, c.owner, stored, lastErr}, kind: stmtStore, owner: m})
	}
	b.pre = append(b.pre, txStmt{sql: releaseMemberSQL, kind: stmtRelease, owner: m})
	m.res = Result{Key: c.Key, Result: storedForm(ran.out, b.l.cfg.MaxResultBytes), Fence: c.Fence, Attempts: c.Attempt, Generation: c.Generation}
}

// commit sends what is pending and the COMMIT, and answers the members whose writes it
// carried.
func (b *txBatch) commit() {
	for {
		stmts, failed, tag, err := b.send([]txStmt{{sql: "COMMIT", kind: stmtCommit}}, nil)
		if err == nil && tag.String() != "COMMIT" {
			// An aborted transaction answers COMMIT with ROLLBACK.
			err = fmt.Errorf("commit answered %q", tag.String())
		}
		if err == nil {
			for _, m := range b.stored {
				b.l.observe(EventCompleted, m.req.TaskType)
				b.reply(m, m.res, nil)
			}
			return
		}
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && failed >= 0 && stmts[failed].kind == stmtStore {
			b.storeFailed(stmts[failed].owner, err)
			if b.broken != nil {
				return
			}
			continue // COMMIT the others
		}
		if errors.As(err, &pgErr) || !b.conn.IsClosed() {
			b.broken = err // answered: nothing committed
			return
		}
		// The answer was lost: each member whose write the COMMIT carried learns the
		// outcome from the transaction id taken at its claim.
		for i, s := range stmts {
			if s.kind == stmtRelease && i >= failed {
				b.stored = append(b.stored, s.owner)
			}
		}
		for _, m := range b.stored {
			b.replyWith(m, txAnswer{res: m.res, lost: err})
		}
		return
	}
}
