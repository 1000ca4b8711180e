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

// committer group-commits the leased claims (Ledger.claims) or the completions and
// failures (Ledger.finishes) of many concurrent callers. A caller queues its row and
// waits. Up to Config.Committers goroutines each take whatever is queued when they start
// a batch (no timer: at low load a batch is one row and adds no latency) and send it, in
// key order and one key at most once per batch, as one multi-row statement committed on
// its own: the statement's fixed cost (parsing its constraints, planning, the commit and
// its WAL flush, the round trips) is paid once per batch instead of once per row. Each
// row keeps its own checks (fence, owner, lease), so each caller gets its own row's
// outcome, and none is answered before the commit is durable. A batch the server refuses
// is split in two and each half committed on its own, down to the row at fault.
type committer struct {
	kind string // BatchClaim or BatchComplete
	name string // prepared statement name
	sql  string // the multi-row statement: arrays of the rows' values, one row per ordinal
	// args returns the statement's arguments for batch.
	args func(batch []*gcOp) []any
	// xid: read every answer before asking for the commit, so that the transaction id
	// is known should the commit's answer be lost.
	xid bool

	mu       sync.Mutex
	queue    []*gcOp
	inFlight map[string]bool // keys of the batches being sent
	running  int
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

// run queues op and waits until its batch committed or failed. A caller whose ctx ends
// while op is still queued leaves with ctx's error; once sent, op's outcome is awaited
// (the batch is bounded by Config.WriteTimeout).
func (c *committer) run(ctx context.Context, l *Ledger, op *gcOp) error {
	op.done = make(chan struct{})
	c.mu.Lock()
	c.queue = append(c.queue, op)
	if c.running < l.cfg.Committers {
		c.running++
		go c.loop(l)
	}
	c.mu.Unlock()
	select {
	case <-op.done:
		return op.err
	case <-ctx.Done():
	}
	c.mu.Lock()
	if i := slices.Index(c.queue, op); i >= 0 {
		c.queue = slices.Delete(c.queue, i, i+1)
		c.mu.Unlock()
		return context.Cause(ctx)
	}
	c.mu.Unlock()
	<-op.done
	return op.err
}

// loop sends batches until nothing it may take is queued.
func (c *committer) loop(l *Ledger) {
	for {
		batch := c.take(l.cfg.MaxBatch)
		if len(batch) == 0 {
			return
		}
		c.commit(l, batch)
		l.observeBatch(c.kind, len(batch))
		c.mu.Lock()
		for _, op := range batch {
			delete(c.inFlight, op.key)
		}
		c.mu.Unlock()
		for _, op := range batch {
			close(op.done)
		}
	}
}

// take removes up to n queued rows whose keys no batch is sending, in key order (so
// that concurrent batches lock rows in one order); when there are none it counts its
// goroutine out.
func (c *committer) take(n int) []*gcOp {
	c.mu.Lock()
	defer c.mu.Unlock()
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
	if len(batch) == 0 {
		c.running--
	}
	slices.SortFunc(batch, func(a, b *gcOp) int { return cmp.Compare(a.key, b.key) })
	return batch
}

// commit commits batch, setting each row's err. When nothing reached the server (a
// connection left over from before a restart) the batch is sent once more; when the
// server refused it, each half is committed on its own.
func (c *committer) commit(l *Ledger, batch []*gcOp) {
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.WriteTimeout)
	defer cancel()
	err := c.send(ctx, l, batch)
	if err != nil && pgconn.SafeToRetry(err) {
		err = c.send(ctx, l, batch)
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

// send sends batch as one statement in a transaction of its own. An error the server
// answered means that nothing committed; a commit whose answer was lost marks every row
// sent.
func (c *committer) send(ctx context.Context, l *Ledger, batch []*gcOp) error {
	for _, op := range batch {
		op.sent = false
		op.reset()
	}
	conn, err := l.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("idempotency: commit: %w", err)
	}
	defer conn.Release()
	pc := conn.Conn()
	sd, err := pc.Prepare(ctx, c.name, c.sql) // once per connection
	if err != nil {
		return fmt.Errorf("idempotency: commit: %w", err)
	}
	m := pc.TypeMap()
	args := c.args(batch)
	params := make([][]byte, len(args))
	for i, a := range args {
		if params[i], err = m.Encode(sd.ParamOIDs[i], pgtype.BinaryFormatCode, a, nil); err != nil {
			return fmt.Errorf("idempotency: commit: argument %d: %w", i+1, err)
		}
	}
	formats := make([]int16, len(params))
	for i := range formats {
		formats[i] = pgtype.BinaryFormatCode
	}

	pipe := pc.PgConn().StartPipeline(ctx)
	defer pipe.Close()
	pipe.SendQueryStatement(sd, params, formats, nil) // text results
	if c.xid {
		pipe.SendFlushRequest()
		if err := pipe.Flush(); err != nil {
			return fmt.Errorf("idempotency: commit: %w", err)
		}
	} else if err := pipe.Sync(); err != nil {
		return fmt.Errorf("idempotency: commit: %w", err)
	}
	if err := readBatch(pipe, m, batch); err != nil {
		if c.xid && !pc.PgConn().IsClosed() {
			pipe.Sync() // ends (rolls back) the transaction; Close reads the answer
		}
		return err
	}
	if c.xid {
		for _, op := range batch {
			op.sent = true
		}
		err = pipe.Sync()
	}
	if err == nil {
		var res any
		res, err = pipe.GetResults()
		if _, ok := res.(*pgconn.PipelineSync); err == nil && !ok {
			err = fmt.Errorf("unexpected pipeline result %T", res)
		}
	}
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) { // answered: not committed
			for _, op := range batch {
				op.sent = false
			}
		}
		return fmt.Errorf("idempotency: commit: %w", err)
	}
	return nil
}

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
