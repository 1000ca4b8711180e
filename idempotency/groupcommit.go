package idempotency

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// committer is one kind of row in the leased group commit (see groupCommit): the leased
// claims (Ledger.claims) or the completions and failures (Ledger.finishes), with the
// multi-row statement that carries a batch of them.
type committer struct {
	kind string // BatchClaim or BatchComplete
	sql  string // the multi-row statement: arrays of the rows' values, one row per ordinal
	// args returns the statement's arguments for batch.
	args func(batch []*gcOp) []any

	name string // its prepared statement's name, when the pool prepares (Ledger.prepare)

	// paramOIDs are sql's parameter types, described once by the server, for sending it
	// unnamed when the pool does not prepare.
	describeMu sync.Mutex
	paramOIDs  []uint32

	// Guarded by groupCommit.mu.
	queue    []*gcOp
	inFlight map[string]bool // keys of the batch being sent
}

// groupCommit commits the leased claims and completions of many concurrent callers
// together. A caller queues its row and waits. Up to Config.Committers goroutines each
// take whatever is queued when they start a round (no timer: at low load a round carries
// one row and adds no latency) and send it, each kind in key order and one key at most
// once per kind, as one multi-row statement per kind — the completions, then the claims
// — in one transaction: the fixed cost of a statement (parsing its constraints, planning,
// the round trips) and of a commit (its WAL flush) is paid once per round instead of once
// per row. Each row keeps its own checks (fence, owner, lease), so each caller gets its own
// row's outcome, and none is answered before the commit is durable. A round the server
// refuses is sent again one kind at a time, and a batch it refuses is split in two and
// each half committed on its own, down to the row at fault.
type groupCommit struct {
	mu      sync.Mutex
	running int
}

// gcOp is one caller's row in a group commit.
type gcOp struct {
	key string
	row any // the committer's row values: *claimArgs or *finishArgs
	// read scans the statement's answer for this row (its first column, the ordinal,
	// already read: scan it into nil). It is not called when no row came back.
	read func(rows pgx.Rows) error
	// reset forgets what read recorded, before the row is sent (again).
	reset func()

	done chan struct{}
	err  error
	// sent is true when the commit was asked for and its answer lost: err is that error
	// and the outcome is unknown (the caller resolves it, if it can).
	sent bool
}

// run queues op as a row of c and waits until its round committed or failed. A caller
// whose ctx ends while op is still queued leaves with ctx's error; once sent, op's outcome
// is awaited (a round is bounded by Config.WriteTimeout).
func (c *committer) run(ctx context.Context, l *Ledger, op *gcOp) error {
	g := &l.group
	op.done = make(chan struct{})
	g.mu.Lock()
	c.queue = append(c.queue, op)
	if g.running < l.cfg.Committers {
		g.running++
		go g.loop(l)
	}
	g.mu.Unlock()
	select {
	case <-op.done:
		return op.err
	case <-ctx.Done():
	}
	g.mu.Lock()
	if i := slices.Index(c.queue, op); i >= 0 {
		c.queue = slices.Delete(c.queue, i, i+1)
		g.mu.Unlock()
		return context.Cause(ctx)
	}
	g.mu.Unlock()
	<-op.done
	return op.err
}

// parts are the kinds a round carries, in the order it sends them.
func (l *Ledger) parts() []*committer { return []*committer{&l.finishes, &l.claims} }

// loop sends rounds until nothing it may take is queued.
func (g *groupCommit) loop(l *Ledger) {
	parts := l.parts()
	for {
		batches := make([][]*gcOp, len(parts))
		n := 0
		g.mu.Lock()
		for i, c := range parts {
			batches[i] = c.take(l.cfg.MaxBatch)
			n += len(batches[i])
		}
		if n == 0 {
			g.running--
		}
		g.mu.Unlock()
		if n == 0 {
			return
		}
		g.commitRound(l, parts, batches)
		for i, c := range parts {
			if len(batches[i]) > 0 {
				l.observeBatch(c.kind, len(batches[i]))
			}
		}
		g.mu.Lock()
		for i, c := range parts {
			for _, op := range batches[i] {
				delete(c.inFlight, op.key)
			}
		}
		g.mu.Unlock()
		for _, b := range batches {
			for _, op := range b {
				close(op.done)
			}
		}
	}
}

// take removes up to n queued rows whose keys no round is sending, in key order (so that
// concurrent rounds lock rows in one order). The caller holds groupCommit.mu.
func (c *committer) take(n int) []*gcOp {
	if c.inFlight == nil {
		c.inFlight = make(map[string]bool)
	}
	var batch []*gcOp
	rest := c.queue[:0]
	for _, op := range c.queue {
		if len(batch) < n && !c.inFlight[op.key] {
			c.inFlight[op.key] = true
			batch = append(batch, op)
		} else {
			rest = append(rest, op)
		}
	}
	clear(c.queue[len(rest):])
	c.queue = rest
	slices.SortFunc(batch, func(a, b *gcOp) int { return cmp.Compare(a.key, b.key) })
	return batch
}

// commitRound commits the batches of every kind in one transaction, setting each row's
// err; if the server refuses the round, each kind is committed on its own.
func (g *groupCommit) commitRound(l *Ledger, parts []*committer, batches [][]*gcOp) {
	var ps []*committer
	var bs [][]*gcOp
	for i, b := range batches {
		if len(b) > 0 {
			ps, bs = append(ps, parts[i]), append(bs, b)
		}
	}
	if len(ps) == 1 {
		ps[0].commit(l, bs[0])
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.WriteTimeout)
	defer cancel()
	err := send(ctx, l, ps, bs)
	if err != nil && pgconn.SafeToRetry(err) {
		err = send(ctx, l, ps, bs)
	}
	var pgErr *pgconn.PgError
	if err != nil && errors.As(err, &pgErr) {
		for i, c := range ps {
			c.commit(l, bs[i])
		}
		return
	}
	for _, b := range bs {
		for _, op := range b {
			op.err = err
		}
	}
}

// commit commits batch, rows of c alone, setting each row's err. When nothing reached
// the server (a connection left over from before a restart) the batch is sent once more;
// when the server refused it, each half is committed on its own.
func (c *committer) commit(l *Ledger, batch []*gcOp) {
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.WriteTimeout)
	defer cancel()
	parts, batches := []*committer{c}, [][]*gcOp{batch}
	err := send(ctx, l, parts, batches)
	if err != nil && pgconn.SafeToRetry(err) {
		err = send(ctx, l, parts, batches)
	}
	var pgErr *pgconn.PgError
	if err != nil && len(batch) > 1 && errors.As(err, &pgErr) {
		half := len(batch) / 2
		c.commit(l, batch[:half])
		c.commit(l, batch[half:])
		return
	}
	for _, op := range batch {
		op.err = err
	}
}

// send sends each batch as its kind's statement, all in one transaction of their own, and
// reads every answer before asking for the commit, so that the completions' transaction
// id is known should the commit's answer be lost. An error the server answered means
// that nothing committed; a commit whose answer was lost marks every row sent.
func send(ctx context.Context, l *Ledger, parts []*committer, batches [][]*gcOp) error {
	for _, b := range batches {
		for _, op := range b {
			op.sent = false
			op.reset()
		}
	}
	conn, err := l.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("idempotency: commit: %w", err)
	}
	defer conn.Release()
	pc := conn.Conn()
	m := pc.TypeMap()
	type stmt struct {
		sql    string
		sd     *pgconn.StatementDescription // nil: sent unnamed
		oids   []uint32
		params [][]byte
	}
	stmts := make([]stmt, len(parts))
	for i, c := range parts {
		var sd *pgconn.StatementDescription
		var oids []uint32
		if l.prepare {
			sd, err = pc.Prepare(ctx, c.name, c.sql) // once per connection
			if sd != nil {
				oids = sd.ParamOIDs
			}
		} else {
			oids, err = c.paramTypes(ctx, pc.PgConn())
		}
		if err != nil {
			return fmt.Errorf("idempotency: commit: %w", err)
		}
		args := c.args(batches[i])
		params := make([][]byte, len(args))
		for j, a := range args {
			if params[j], err = m.Encode(oids[j], pgtype.BinaryFormatCode, a, nil); err != nil {
				return fmt.Errorf("idempotency: commit: argument %d: %w", j+1, err)
			}
		}
		stmts[i] = stmt{c.sql, sd, oids, params}
	}

	pipe := pc.PgConn().StartPipeline(ctx)
	defer pipe.Close()
	pipe.SendQueryParams(claimSettingsSQL, [][]byte{[]byte(l.lockTimeoutSQL)}, nil, nil, nil)
	for _, s := range stmts {
		formats := make([]int16, len(s.params))
		for j := range formats {
			formats[j] = pgtype.BinaryFormatCode
		}
		if s.sd != nil {
			pipe.SendQueryStatement(s.sd, s.params, formats, nil) // text results
		} else {
			pipe.SendQueryParams(s.sql, s.params, s.oids, formats, nil)
		}
	}
	// With completions in the round, every answer is read before the commit is asked
	// for, so that their transaction id is known should the commit's answer be lost;
	// claims alone are sent with the commit.
	xid := slices.Contains(parts, &l.finishes)
	if xid {
		pipe.SendFlushRequest()
		err = pipe.Flush()
	} else {
		err = pipe.Sync()
	}
	if err != nil {
		return fmt.Errorf("idempotency: commit: %w", err)
	}
	var res any
	if res, err = pipe.GetResults(); err == nil { // the settings
		if rr, ok := res.(*pgconn.ResultReader); ok {
			_, err = rr.Close()
		} else {
			err = fmt.Errorf("unexpected pipeline result %T", res)
		}
	}
	if err != nil {
		if xid && !pc.PgConn().IsClosed() {
			pipe.Sync()
		}
		return fmt.Errorf("idempotency: commit: %w", err)
	}
	for _, b := range batches {
		if err := readBatch(pipe, m, b); err != nil {
			if xid && !pc.PgConn().IsClosed() {
				pipe.Sync() // ends (rolls back) the transaction; Close reads the answer
			}
			return err
		}
	}
	for _, b := range batches {
		for _, op := range b {
			op.sent = true
		}
	}
	if xid {
		err = pipe.Sync()
	}
	if err == nil {
		res, err = pipe.GetResults()
		if _, ok := res.(*pgconn.PipelineSync); err == nil && !ok {
			err = fmt.Errorf("unexpected pipeline result %T", res)
		}
	}
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) { // answered: not committed
			for _, b := range batches {
				for _, op := range b {
					op.sent = false
				}
			}
		}
		return fmt.Errorf("idempotency: commit: %w", err)
	}
	return nil
}

// The multi-row statements join arrays of keys to processed_jobs and job_intents. A plan
// made while a table was small (after a deploy, a purge or a TRUNCATE) may join by
// scanning the whole table, and a connection keeps a prepared statement's plan as the
// table grows: at 50,000 rows the leased stack fell to a fifth of its speed. So these
// statements are planned with sequential scans, hash and merge joins off (keyPlansSQL,
// for the rest of the transaction; restorePlansSQL puts the settings back): the joins
// then take the primary keys whatever the tables' sizes, and the plan is made once per
// connection, not once per batch.
const (
	keyPlansSQL = `SELECT set_config('idemq.saved_plans', concat_ws(',', current_setting('enable_seqscan'),
	       current_setting('enable_hashjoin'), current_setting('enable_mergejoin')), true),
	       set_config('enable_seqscan', 'off', true), set_config('enable_hashjoin', 'off', true),
	       set_config('enable_mergejoin', 'off', true)`
	// claimSettingsSQL is keyPlansSQL plus the bound on the claims' waits for another
	// session's row ($1, as "2000ms"), for the rest of the transaction;
	// restoreClaimSettingsSQL puts all of them back.
	claimSettingsSQL = keyPlansSQL + `,
	       set_config('idemq.saved_lock_timeout', current_setting('lock_timeout'), true), set_config('lock_timeout', $1, true)`
	restoreClaimSettingsSQL = restorePlansSQL + `,
	       set_config('lock_timeout', current_setting('idemq.saved_lock_timeout'), true)`
	restorePlansSQL = `SELECT set_config('enable_seqscan', split_part(current_setting('idemq.saved_plans'), ',', 1), true),
	       set_config('enable_hashjoin', split_part(current_setting('idemq.saved_plans'), ',', 2), true),
	       set_config('enable_mergejoin', split_part(current_setting('idemq.saved_plans'), ',', 3), true)`
)

// readBatch hands each answered row to the batch member its ordinal (1-based) names.
func readBatch(pipe *pgconn.Pipeline, m *pgtype.Map, batch []*gcOp) error {
	res, err := pipe.GetResults()
	if err != nil {
		return err
	}
	rr, ok := res.(*pgconn.ResultReader)
	if !ok {
		return fmt.Errorf("idempotency: commit: unexpected pipeline result %T", res)
	}
	rows := pgx.RowsFromResultReader(m, rr)
	defer rows.Close()
	for rows.Next() {
		ord, err := strconv.Atoi(string(rows.RawValues()[0]))
		if err != nil || ord < 1 || ord > len(batch) {
			return fmt.Errorf("idempotency: commit: answer for row %q of %d", rows.RawValues()[0], len(batch))
		}
		if err := batch[ord-1].read(rows); err != nil {
			return fmt.Errorf("idempotency: commit %s: %w", batch[ord-1].key, err)
		}
	}
	rows.Close()
	return rows.Err()
}

// paramTypes returns the committer's parameter types, described by the server (as an
// unnamed statement) the first time.
func (c *committer) paramTypes(ctx context.Context, conn *pgconn.PgConn) ([]uint32, error) {
	c.describeMu.Lock()
	defer c.describeMu.Unlock()
	if c.paramOIDs == nil {
		sd, err := conn.Prepare(ctx, "", c.sql, nil)
		if err != nil {
			return nil, err
		}
		c.paramOIDs = sd.ParamOIDs
	}
	return c.paramOIDs, nil
}
