package idempotency

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// committer group-commits single-row statements of many concurrent callers: leased claims
// (Ledger.claims) or fenced completions (Ledger.finishes). A caller queues its statement
// and waits. Up to Config.Committers goroutines each take whatever is queued when they
// start a batch (no timer: at low load a batch is one statement and adds no latency) and
// send it, in key order and one key at most once per batch, as one implicit transaction
// of the extended protocol: all statements, then one Sync that commits them together.
// Each statement keeps its own checks (fence, owner, lease), so each caller gets its own
// row's outcome. A statement the server refuses aborts the transaction: it is then run
// alone and the others again without it, so one bad member costs only itself.
type committer struct {
	kind     string // for Config.ObserveBatch
	mu       sync.Mutex
	queue    []*gcOp
	inFlight map[string]bool // keys of the batches being sent
	running  int
}

// gcOp is one caller's statement in a group commit.
type gcOp struct {
	key  string
	name string // prepared statement name
	sql  string
	args []any
	// read reads the statement's result; it is called once the statement ran, before
	// the commit, and again if the batch is sent again.
	read func(rr *pgconn.ResultReader, m *pgtype.Map) error

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
		l.commitBatch(batch)
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

// take removes up to n queued statements whose keys no batch is sending, in key order;
// when there are none it counts its goroutine out.
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

// commitBatch commits batch, setting each statement's err. Nothing reached the server
// (a connection left over from before a restart): the batch is sent once more.
func (l *Ledger) commitBatch(batch []*gcOp) {
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.WriteTimeout)
	defer cancel()
	failed, err := l.sendBatch(ctx, batch)
	if err != nil && failed < 0 && pgconn.SafeToRetry(err) {
		failed, err = l.sendBatch(ctx, batch)
	}
	switch {
	case err == nil:
		for _, op := range batch {
			op.err = nil
		}
	case failed >= 0 && len(batch) > 1:
		// The server refused one statement, which rolled back all of them: that one
		// alone, then the others without it.
		l.commitBatch(batch[failed : failed+1])
		l.commitBatch(slices.Concat(batch[:failed], batch[failed+1:]))
	default:
		for _, op := range batch {
			op.err = err
		}
	}
}

// sendBatch sends batch as one transaction on one connection. failed is the index of the
// statement the server refused (-1 for none); then err is its error and nothing
// committed. A commit whose answer was lost marks every statement sent.
func (l *Ledger) sendBatch(ctx context.Context, batch []*gcOp) (failed int, err error) {
	for _, op := range batch {
		op.sent = false
	}
	conn, err := l.pool.Acquire(ctx)
	if err != nil {
		return -1, fmt.Errorf("idempotency: commit: %w", err)
	}
	defer conn.Release()
	return sendOn(ctx, conn, batch)
}

func sendOn(ctx context.Context, conn *pgxpool.Conn, batch []*gcOp) (failed int, err error) {
	pc := conn.Conn()
	m := pc.TypeMap()
	type stmt struct {
		sd     *pgconn.StatementDescription
		params [][]byte
	}
	stmts := make([]stmt, len(batch))
	for i, op := range batch {
		sd, err := pc.Prepare(ctx, op.name, op.sql) // once per connection
		if err != nil {
			return -1, fmt.Errorf("idempotency: commit %s: %w", op.key, err)
		}
		params := make([][]byte, len(op.args))
		for j, a := range op.args {
			if params[j], err = m.Encode(sd.ParamOIDs[j], pgtype.TextFormatCode, a, nil); err != nil {
				return -1, fmt.Errorf("idempotency: commit %s: argument %d: %w", op.key, j+1, err)
			}
		}
		stmts[i] = stmt{sd, params}
	}

	pipe := pc.PgConn().StartPipeline(ctx)
	defer pipe.Close()
	for _, s := range stmts {
		pipe.SendQueryStatement(s.sd, s.params, nil, nil) // text formats
	}
	// Read every answer before asking for the commit, so that the completions' transaction
	// id is known should the commit's answer be lost.
	pipe.SendFlushRequest()
	if err := pipe.Flush(); err != nil {
		return -1, fmt.Errorf("idempotency: commit: %w", err)
	}
	for i, op := range batch {
		res, err := pipe.GetResults()
		if err == nil {
			rr, ok := res.(*pgconn.ResultReader)
			if !ok {
				return -1, fmt.Errorf("idempotency: commit %s: unexpected pipeline result %T", op.key, res)
			}
			err = op.read(rr, m)
			if _, cerr := rr.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			pipe.Sync() // ends (rolls back) the transaction; Close reads the answer
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) {
				return i, err
			}
			return -1, fmt.Errorf("idempotency: commit %s: %w", op.key, err)
		}
	}
	for _, op := range batch {
		op.sent = true
	}
	err = pipe.Sync()
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
		return -1, fmt.Errorf("idempotency: commit: %w", err)
	}
	return -1, nil
}
