package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/tasks"
)

// wakeChannel is the LISTEN/NOTIFY channel relays wait on.
const wakeChannel = "idemq_outbox"

// takePendingSQL takes up to $1 pending intents (only keys in $3 when it is not NULL) for
// $2 ms in one short statement: SKIP LOCKED lets every replica's relay run at once.
const takePendingSQL = `
UPDATE job_intents SET relay_until = now() + $2::bigint * interval '1 millisecond', updated_at = now()
WHERE idempotency_key IN (
	SELECT idempotency_key FROM job_intents
	WHERE state = 'pending' AND (relay_until IS NULL OR relay_until < now())
	  AND ($3::text[] IS NULL OR idempotency_key = ANY($3::text[]))
	ORDER BY created_at
	LIMIT $1
	FOR UPDATE SKIP LOCKED)
RETURNING idempotency_key, task_type, payload, queue, max_retry, timeout_ms, retention_ms, publish_generation, created_at`

const markPublishedSQL = `
UPDATE job_intents SET state = 'published', published_at = now(), relay_until = NULL, last_error = NULL, updated_at = now()
WHERE idempotency_key = ANY($1::text[]) AND state = 'pending'`

const markPublishFailedSQL = `
UPDATE job_intents SET relay_until = now() + $2::bigint * interval '1 millisecond', last_error = $3, updated_at = now()
WHERE idempotency_key = ANY($1::text[]) AND state = 'pending'`

// intentRow is an intent taken for publishing.
type intentRow struct {
	spec      tasks.Spec
	gen       int
	createdAt time.Time
}

func (c *Client) takePending(ctx context.Context, keys []string) ([]intentRow, error) {
	var only any
	if keys != nil {
		only = keys
	}
	rows, err := c.pool.Query(ctx, takePendingSQL, c.cfg.RelayBatch, c.cfg.RelayHold.Milliseconds(), only)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, scanIntentRow)
}

// scanIntentRow reads the columns takePendingSQL and staleIntentsSQL return.
func scanIntentRow(row pgx.CollectableRow) (intentRow, error) {
	var r intentRow
	var timeout, retention int64
	err := row.Scan(&r.spec.Key, &r.spec.Type, &r.spec.Payload, &r.spec.Queue, &r.spec.MaxRetry,
		&timeout, &retention, &r.gen, &r.createdAt)
	r.spec.Timeout, r.spec.Retention = time.Duration(timeout)*time.Millisecond, time.Duration(retention)*time.Millisecond
	return r, err
}

// publish hands one intent's task to asynq. A TaskID conflict means asynq has (or had)
// the task: published.
func (c *Client) publish(ctx context.Context, r intentRow) error {
	_, err := c.asynq.EnqueueContext(ctx, r.spec.Task(taskID(r.spec.Key, r.gen), r.createdAt))
	if err != nil && !errors.Is(err, asynq.ErrTaskIDConflict) {
		return err
	}
	return nil
}

// registerQueues adds the batch's queues to asynq's set of queues. asynq's client does
// that only on its first enqueue to a queue, so after Redis restarted empty a long-lived
// client would never register the queue again, and asynq's Inspector (the dashboard, the
// queue metrics) would answer "queue not found" although tasks are processed.
func (c *Client) registerQueues(ctx context.Context, batch []intentRow) error {
	seen := map[string]bool{}
	var queues []any
	for _, r := range batch {
		if !seen[r.spec.Queue] {
			seen[r.spec.Queue] = true
			queues = append(queues, r.spec.Queue)
		}
	}
	return c.rdb.SAdd(ctx, asynqQueuesKey, queues...).Err()
}

// publishPending publishes one batch of pending intents (only keys, when not nil) and
// returns how many it published. On a publish error it stops, gives the rest of the
// batch back for a retry after a pause, and returns the error.
func (c *Client) publishPending(ctx context.Context, keys []string) (int, error) {
	batch, err := c.takePending(ctx, keys)
	if err != nil {
		return 0, fmt.Errorf("idempotency: take pending intents: %w", err)
	}
	done := make([]string, 0, len(batch))
	var pubErr error
	if len(batch) > 0 {
		pubErr = c.registerQueues(ctx, batch)
	}
	var failed []string
	for i, r := range batch {
		if pubErr == nil {
			pubErr = c.publish(ctx, r)
		}
		if pubErr != nil {
			for _, r := range batch[i:] {
				failed = append(failed, r.spec.Key)
				c.observe(EventRelayError, r.spec.Type)
			}
			break
		}
		done = append(done, r.spec.Key)
		c.observe(EventPublished, r.spec.Type)
	}
	// Record the outcome even when ctx ended: the publishes happened.
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if len(done) > 0 {
		if _, err := c.pool.Exec(wctx, markPublishedSQL, done); err != nil {
			// The intents come back after RelayHold and are published again: a TaskID
			// conflict then, which counts as published.
			return 0, fmt.Errorf("idempotency: mark intents published: %w", err)
		}
	}
	if pubErr != nil {
		if _, err := c.pool.Exec(wctx, markPublishFailedSQL, failed, time.Second.Milliseconds(), cleanText(pubErr.Error())); err != nil {
			c.log.Warn("record publish failure", "err", err)
		}
		return len(done), fmt.Errorf("idempotency: publish: %w", pubErr)
	}
	return len(done), nil
}

// RunRelay publishes committed intents until ctx ends: at once when woken (Wake, on a
// dedicated LISTEN connection), else every ClientConfig.RelayPoll. While Redis is down it
// backs off (up to 5 s) and drops nothing. Every replica may run a relay: they take
// disjoint batches. It returns nil when ctx ends.
func (c *Client) RunRelay(ctx context.Context) error {
	wake := make(chan struct{}, 1)
	go c.listen(ctx, wake)
	backoff := time.Duration(0)
	for ctx.Err() == nil {
		n, err := c.publishPending(ctx, nil)
		switch {
		case err != nil && ctx.Err() == nil:
			backoff = min(max(2*backoff, 100*time.Millisecond), 5*time.Second)
			c.log.Warn("relay", "err", err, "retry_in", backoff)
		case n == c.cfg.RelayBatch:
			backoff = 0
			continue // more may be waiting
		default:
			backoff = 0
		}
		wait := c.cfg.RelayPoll
		if backoff > 0 {
			wait = backoff
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
		case <-t.C:
		case <-wake:
		}
		t.Stop()
	}
	return nil
}

// listen holds a dedicated connection LISTENing on wakeChannel and signals wake for each
// notification, reconnecting with a pause after errors, until ctx ends.
func (c *Client) listen(ctx context.Context, wake chan<- struct{}) {
	for ctx.Err() == nil {
		err := c.listenOnce(ctx, wake)
		if ctx.Err() != nil {
			return
		}
		c.log.Debug("relay wake-up connection", "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

func (c *Client) listenOnce(ctx context.Context, wake chan<- struct{}) error {
	conn, err := pgx.ConnectConfig(ctx, c.pool.Config().ConnConfig.Copy())
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+wakeChannel); err != nil {
		return err
	}
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		select {
		case wake <- struct{}{}:
		default:
		}
	}
}
