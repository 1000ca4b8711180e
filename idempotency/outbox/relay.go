package outbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/idempotency/pgpooler"
)

// wakeChannel is the LISTEN/NOTIFY channel relays wait on.
const wakeChannel = "idemq_outbox"

// PlanEach, as a statement's first argument, has Postgres plan the statement for its
// arguments each time (an unnamed statement) instead of reusing a generic plan: a generic
// plan made while job_intents was small (a new deployment, an emptied table) scans the
// whole table for a few keys until the next ANALYZE, which under load comes minutes later.
// The outbox's own statements that look up intents by key are sent so.
const PlanEach = pgx.QueryExecModeCacheDescribe

// intentRow is an intent taken for publishing (or republishing).
type intentRow struct {
	spec        Spec
	gen         int
	createdAt   time.Time
	publishedAt time.Time // its last publish; createdAt while pending
}

func (c *Client) takePending(ctx context.Context, keys []string) ([]intentRow, error) {
	rows, err := store.TakePending(ctx, c.pool, store.TakeParams{Limit: c.cfg.RelayBatch, Hold: c.cfg.RelayHold, Keys: keys})
	return intentRows(rows), err
}

// intentRows returns the intents of rows, as the relays and the reconciler take them.
func intentRows(rows []store.IntentRow) []intentRow {
	out := make([]intentRow, len(rows))
	for i, r := range rows {
		out[i] = intentRow{
			spec: Spec{Key: r.Key, Type: r.TaskType, Payload: r.Payload, Queue: r.Queue, MaxRetry: r.MaxRetry,
				Timeout: r.Timeout, Retention: r.Retention, TraceParent: r.TraceParent},
			gen: r.Generation, createdAt: r.CreatedAt, publishedAt: r.PublishedAt,
		}
	}
	return out
}

// maxTaskIDSkips bounds how many TaskIDs held by other tasks one publish moves past.
const maxTaskIDSkips = 8

// publish hands one intent's task to asynq under the TaskID of generation r.gen and
// returns the generation it is published under. A TaskID conflict with this intent's own
// task (the same type and payload) means asynq has (or had) it: published. A conflict
// with another task (a plain asynq producer chose this TaskID) is not this job: it moves
// on to the next generation's TaskID, so the job is never mistaken for a task that is not
// it.
func (c *Client) publish(ctx context.Context, r intentRow) (gen int, err error) {
	if r.spec.TraceParent != "" { // a producer span in the job's trace
		var span trace.Span
		ctx, span = c.startPublishSpan(ctx, r)
		defer func() { endPublishSpan(span, r.spec.Key, gen, err) }()
	}
	return c.publishAs(ctx, r)
}

func (c *Client) publishAs(ctx context.Context, r intentRow) (int, error) {
	gen := r.gen
	for try := 0; try <= maxTaskIDSkips; try++ {
		id := taskID(r.spec.Key, gen)
		_, err := c.asynq.EnqueueContext(ctx, r.spec.Task(id, r.createdAt))
		if err == nil {
			return gen, nil
		}
		if !errors.Is(err, asynq.ErrTaskIDConflict) {
			return r.gen, err
		}
		match, err := c.holdsTask(ctx, r, id)
		switch {
		case err != nil:
			return r.gen, err
		case match == taskIsThisJob || match == taskIsThisJobDone:
			return gen, nil
		case match == taskIsOther:
			c.log.Warn("TaskID held by another task; publishing under the next one",
				"task_type", r.spec.Type, "key", r.spec.Key, "task_id", id)
			gen++
		}
		// taskMissing: it went away between the conflict and the look-up; try it again.
	}
	return r.gen, fmt.Errorf("%s: TaskIDs from generation %d on are held by other tasks", r.spec.Key, r.gen)
}

// taskMatch is what Redis holds under an intent's TaskID.
type taskMatch int

const (
	taskMissing       taskMatch = iota // no task, no queue, or a hash without a message
	taskIsThisJob                      // the intent's task: the same type and payload
	taskIsThisJobDone                  // the intent's task, which asynq completed
	taskIsOther                        // another task under the same TaskID
)

// holdsTask reports what Redis holds under TaskID id in r's queue.
func (c *Client) holdsTask(ctx context.Context, r intentRow, id string) (taskMatch, error) {
	match, _, err := c.lookTask(ctx, r, id)
	return match, err
}

// lookTask is holdsTask with the task's info when Redis holds it (nil otherwise).
func (c *Client) lookTask(_ context.Context, r intentRow, id string) (taskMatch, *asynq.TaskInfo, error) {
	info, err := c.insp.GetTaskInfo(r.spec.Queue, id)
	switch {
	case errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound):
		return taskMissing, nil, nil
	case err != nil:
		return taskMissing, nil, fmt.Errorf("look up task %s: %w", id, err)
	case info.Type != r.spec.Type || !bytes.Equal(idempotency.Fingerprint(info.Type, info.Payload), idempotency.Fingerprint(r.spec.Type, r.spec.Payload)):
		return taskIsOther, info, nil
	case info.State == asynq.TaskStateCompleted:
		return taskIsThisJobDone, info, nil
	default:
		return taskIsThisJob, info, nil
	}
}

// prepareQueues readies the batch's queues for publishing: registered with asynq, an
// epoch marker in Redis (markEpochs) and an epoch row in Postgres. It returns the
// markers, to check after publishing.
func (c *Client) prepareQueues(ctx context.Context, batch []intentRow) (map[string]string, error) {
	marks, err := c.markEpochs(ctx, queuesOf(batch))
	if err != nil {
		return nil, err
	}
	return marks, c.ensureEpochs(ctx, marks)
}

// publishers is how many publishes of one batch go to Redis at once: one at a time, a
// relay round of 100 intents paid 100 round trips in a row and fell behind a busy API.
const publishers = 16

// publishPending takes one batch of pending intents (only keys, when not nil) and
// publishes it (publishRows).
func (c *Client) publishPending(ctx context.Context, keys []string) ([]string, error) {
	batch, err := c.takePending(ctx, keys)
	if err != nil {
		return nil, fmt.Errorf("outbox: take pending intents: %w", err)
	}
	if len(batch) == 0 {
		return nil, nil
	}
	return c.publishRows(ctx, batch)
}

// publishRows publishes batch, up to publishers at once, records the publishes and
// returns the keys it published. The intents whose publish failed are given back for a
// retry after a pause, and the first error is returned.
func (c *Client) publishRows(ctx context.Context, batch []intentRow) ([]string, error) {
	marks, pubErr := c.prepareQueues(ctx, batch)
	gens, errs := make([]int, len(batch)), make([]error, len(batch))
	published := make([]bool, len(batch))
	if pubErr == nil {
		var wg sync.WaitGroup
		next := make(chan int)
		for range min(publishers, len(batch)) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range next {
					gens[i], errs[i] = c.publish(ctx, batch[i])
				}
			}()
		}
		for i := range batch {
			next <- i
		}
		close(next)
		wg.Wait()
		for i, err := range errs {
			published[i] = err == nil
		}
		pubErr = firstError(errs)
	}
	var done []store.Publish
	var failed []string
	for i, r := range batch {
		if published[i] {
			done = append(done, store.Publish{Key: r.spec.Key, Taken: r.gen, Generation: gens[i]})
		} else {
			failed = append(failed, r.spec.Key)
		}
	}
	if len(done) > 0 {
		// A publish counts only if Redis kept its queue's data meanwhile: else publish
		// the batch again (a TaskID conflict with the job's own task is a success).
		same, err := c.epochsUnchanged(ctx, marks)
		if err == nil && !same {
			err = errEpochChanged
		}
		if err != nil {
			pubErr = err
			failed, done = append(keysOf(done), failed...), nil
			clear(published)
		}
	}
	// Record the outcome even when ctx ended: the publishes happened. Count each intent
	// once its outcome is recorded.
	defer func() {
		for i, r := range batch {
			if published[i] {
				c.observe(EventPublished, r.spec.Type)
			} else {
				c.observe(EventRelayError, r.spec.Type)
			}
		}
	}()
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if len(done) > 0 {
		if err := store.MarkPublished(wctx, c.pool, done); err != nil {
			// The intents come back after RelayHold and are published again: a TaskID
			// conflict then, which counts as published.
			clear(published)
			return nil, fmt.Errorf("outbox: mark intents published: %w", err)
		}
	}
	if pubErr != nil {
		if err := store.MarkPublishFailed(wctx, c.pool, failed, time.Second, store.CleanText(pubErr.Error())); err != nil {
			c.log.Warn("record publish failure", "err", err)
		}
		return keysOf(done), fmt.Errorf("outbox: publish: %w", pubErr)
	}
	return keysOf(done), nil
}

// keysOf returns the keys of ps.
func keysOf(ps []store.Publish) []string {
	keys := make([]string, len(ps))
	for i, p := range ps {
		keys[i] = p.Key
	}
	return keys
}

// firstError is the first non-nil error of errs.
func firstError(errs []error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// RunRelay publishes committed intents until ctx ends: at once when woken (Wake, on a
// dedicated LISTEN connection), else every Config.RelayPoll. Up to Config.Relays rounds run
// at once: a round that found a full batch brings in another, so a backlog is published
// in parallel and an idle relay costs one round per poll. While Redis is down it backs off
// (up to 5 s) and drops nothing. Every replica may run a relay: rounds take disjoint
// batches. It returns nil when ctx ends.
func (c *Client) RunRelay(ctx context.Context) error {
	go c.listen(ctx)
	var wg sync.WaitGroup
	for i := range c.cfg.Relays {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.relayLoop(ctx, c.wake, i == 0)
		}()
	}
	wg.Wait()
	return nil
}

// relayLoop runs relay rounds until ctx ends; only the polling loop wakes up by itself
// every RelayPoll, the others only when woken.
func (c *Client) relayLoop(ctx context.Context, wake chan struct{}, polling bool) {
	backoff := time.Duration(0)
	for ctx.Err() == nil {
		done, err := c.publishPending(ctx, nil)
		switch {
		case err != nil && ctx.Err() == nil:
			backoff = min(max(2*backoff, 100*time.Millisecond), 5*time.Second)
			c.log.Warn("relay", "err", err, "retry_in", backoff)
		case len(done) == c.cfg.RelayBatch:
			backoff = 0
			select { // more may be waiting: another round may join in
			case wake <- struct{}{}:
			default:
			}
			continue
		default:
			backoff = 0
		}
		wait := c.cfg.RelayPoll
		if backoff > 0 {
			wait = backoff
		}
		var poll <-chan time.Time
		var t *time.Timer
		if polling || backoff > 0 {
			t = time.NewTimer(wait)
			poll = t.C
		}
		select {
		case <-ctx.Done():
		case <-poll:
		case <-wake:
		}
		if t != nil {
			t.Stop()
		}
	}
}

// errPooledListen: the LISTEN connection reaches a transaction-mode pooler.
var errPooledListen = errors.New("the relay's LISTEN connection reaches a transaction-mode pooler, where a LISTEN hears nothing and pins a server connection")

// listen holds a dedicated connection LISTENing on wakeChannel and wakes the relays for
// each notification, reconnecting with a pause after errors, until ctx ends or the
// connection turns out to reach a transaction-mode pooler.
func (c *Client) listen(ctx context.Context) {
	for ctx.Err() == nil {
		err := c.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, errPooledListen) {
			c.log.Warn("relay: not listening for wake-ups: "+err.Error()+"; relays poll instead (give the outbox a direct connection: IDEMQ_DIRECT_DATABASE_URL)",
				"poll", c.cfg.RelayPoll)
			return
		}
		c.log.Debug("relay wake-up connection", "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

func (c *Client) listenOnce(ctx context.Context) error {
	cfg := c.cfg.Listen
	if cfg == nil {
		cfg = c.pool.Config().ConnConfig
	}
	conn, err := pgx.ConnectConfig(ctx, cfg.Copy())
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if pooled, err := pgpooler.IsPooled(ctx, conn); err != nil {
		return err
	} else if pooled {
		if kind, err := pgpooler.Detect(ctx, cfg); err != nil {
			return err
		} else if kind == pgpooler.TransactionPooler {
			return errPooledListen
		}
	}
	if _, err := conn.Exec(ctx, "LISTEN "+wakeChannel); err != nil {
		return err
	}
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		c.signal()
	}
}
