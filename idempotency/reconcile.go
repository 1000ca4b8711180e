package idempotency

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"
)

// finishIntentsSQL settles intents whose key the ledger has completed or failed (a
// completion normally does this itself; this catches keys completed by another path, such
// as a duplicate answered from the ledger).
const finishIntentsSQL = `
UPDATE job_intents i
SET state = CASE p.status WHEN 'completed' THEN 'done' ELSE 'dead' END, finished_at = now(), updated_at = now()
FROM processed_jobs p
WHERE p.idempotency_key = i.idempotency_key AND i.state IN ('pending', 'published')
  AND p.status IN ('completed', 'failed')`

// staleIntentsSQL lists published intents older than $1 ms, oldest first.
const staleIntentsSQL = `
SELECT idempotency_key, task_type, payload, queue, max_retry, timeout_ms, retention_ms, publish_generation, created_at
FROM job_intents
WHERE state = 'published' AND published_at < now() - $1::bigint * interval '1 millisecond'
ORDER BY published_at
LIMIT $2`

// bumpGenerationSQL records a republish, unless another reconciler did it first.
const bumpGenerationSQL = `
UPDATE job_intents SET publish_generation = $2 + 1, published_at = now(), updated_at = now()
WHERE idempotency_key = $1 AND state = 'published' AND publish_generation = $2`

// ReconcileStats says what one reconcile round did.
type ReconcileStats struct {
	Finished    int64 // intents settled from the ledger
	Checked     int   // published intents older than the grace period, looked up in Redis
	Missing     int   // of those, missing from Redis (no queue, no task, or an orphaned hash)
	Republished int   // republished under a new TaskID
}

// Reconcile settles intents the ledger has finished, then republishes published intents
// older than grace whose task Redis no longer has, under TaskID key#r<generation> (never
// colliding with an orphaned or archived task; the ledger dedups across generations). It
// checks at most 1000 intents per call and republishes at most
// ClientConfig.RepublishPerSecond per second. Safe for concurrent use.
func (c *Client) Reconcile(ctx context.Context, grace time.Duration) (ReconcileStats, error) {
	var st ReconcileStats
	tag, err := c.pool.Exec(ctx, finishIntentsSQL)
	if err != nil {
		return st, fmt.Errorf("idempotency: settle intents: %w", err)
	}
	st.Finished = tag.RowsAffected()

	rows, err := c.pool.Query(ctx, staleIntentsSQL, grace.Milliseconds(), 1000)
	if err != nil {
		return st, fmt.Errorf("idempotency: list stale intents: %w", err)
	}
	stale, err := pgx.CollectRows(rows, scanIntentRow)
	if err != nil {
		return st, fmt.Errorf("idempotency: list stale intents: %w", err)
	}
	st.Checked = len(stale)
	if len(stale) == 0 {
		return st, nil
	}
	present, err := c.tasksPresent(ctx, stale)
	if err != nil {
		return st, err
	}
	var missing []intentRow
	for i, r := range stale {
		if !present[i] {
			missing = append(missing, r)
		}
	}
	if len(missing) > 0 {
		if err := c.registerQueues(ctx, missing); err != nil {
			return st, fmt.Errorf("idempotency: register queues: %w", err)
		}
	}
	limiter := rate.NewLimiter(rate.Limit(c.cfg.RepublishPerSecond), 1)
	for i, r := range stale {
		if present[i] {
			continue
		}
		st.Missing++
		if err := limiter.Wait(ctx); err != nil {
			return st, err
		}
		next := r
		next.gen = r.gen + 1
		if err := c.publish(ctx, next); err != nil {
			return st, fmt.Errorf("idempotency: republish %s: %w", r.spec.Key, err)
		}
		tag, err := c.pool.Exec(ctx, bumpGenerationSQL, r.spec.Key, r.gen)
		if err != nil {
			return st, fmt.Errorf("idempotency: record republish of %s: %w", r.spec.Key, err)
		}
		if tag.RowsAffected() == 0 {
			continue // another reconciler republished it, or it finished meanwhile
		}
		st.Republished++
		c.observe(EventRepublished, r.spec.Type)
		log := c.log.With("task_type", r.spec.Type, "key", r.spec.Key, "task_id", taskID(r.spec.Key, next.gen))
		if next.gen >= c.cfg.AlertGeneration {
			c.observe(EventRepublishAlert, r.spec.Type)
			log.Error("job republished again: Redis keeps losing it, or it never completes", "generation", next.gen)
		} else {
			log.Warn("job missing from Redis; republished", "generation", next.gen)
		}
	}
	return st, nil
}

// tasksPresent reports, for each intent, whether Redis holds its current task with a
// message: a missing queue, a missing task hash and an orphaned hash without a message
// (left by a late result write) all count as absent.
func (c *Client) tasksPresent(ctx context.Context, rs []intentRow) ([]bool, error) {
	cmds := make([]*redis.BoolCmd, len(rs))
	_, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, r := range rs {
			cmds[i] = p.HExists(ctx, asynqTaskKey(r.spec.Queue, taskID(r.spec.Key, r.gen)), "msg")
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("idempotency: look up tasks in Redis: %w", err)
	}
	out := make([]bool, len(rs))
	for i, cmd := range cmds {
		out[i] = cmd.Val()
	}
	return out, nil
}

// asynqTaskKey is where asynq keeps a task's hash (asynq's internal base.TaskKey).
func asynqTaskKey(queue, id string) string { return "asynq:{" + queue + "}:t:" + id }

// asynqQueuesKey is asynq's set of all queues (its internal base.AllQueues).
const asynqQueuesKey = "asynq:queues"

// RunReconciler reconciles every ClientConfig.ReconcileEvery with the grace period, and at
// once, with no grace, when Redis restarted (its run_id changed, so it may have come back
// empty), until ctx ends. It returns nil when ctx ends. Every replica may run it.
func (c *Client) RunReconciler(ctx context.Context) error {
	runID := c.redisRunID(ctx)
	tick := time.NewTicker(c.cfg.ReconcileEvery)
	defer tick.Stop()
	probe := time.NewTicker(2 * time.Second)
	defer probe.Stop()
	for {
		grace := time.Duration(-1)
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
			grace = c.cfg.Grace
		case <-probe.C:
			id := c.redisRunID(ctx)
			if id != "" && runID != "" && id != runID {
				c.log.Warn("Redis restarted (run_id changed); reconciling now", "old_run_id", runID, "run_id", id)
				grace = 0
			}
			if id != "" {
				runID = id
			}
		}
		if grace < 0 {
			continue
		}
		st, err := c.Reconcile(ctx, grace)
		if err != nil && ctx.Err() == nil {
			c.log.Warn("reconcile", "err", err)
			if grace == 0 {
				runID = "" // try the immediate round again at the next probe
			}
			continue
		}
		if st.Missing > 0 || st.Finished > 0 {
			c.log.Info("reconciled", "settled", st.Finished, "checked", st.Checked, "missing", st.Missing, "republished", st.Republished)
		}
	}
}

func (c *Client) redisRunID(ctx context.Context) string {
	info, err := c.rdb.Info(ctx, "server").Result()
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "run_id:"); ok {
			return v
		}
	}
	return ""
}

// OutboxStats is the outbox's backlog, for metrics.
type OutboxStats struct {
	Pending            int
	OldestPending      time.Duration // relay lag
	Published          int           // published, not yet done or dead
	OldestPublished    time.Duration
	PublishedOlderThan int // published longer ago than the threshold asked for
}

const outboxStatsSQL = `
SELECT count(*) FILTER (WHERE state = 'pending'),
       coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE state = 'pending')), 0)::float8,
       count(*) FILTER (WHERE state = 'published'),
       coalesce(extract(epoch FROM now() - min(published_at) FILTER (WHERE state = 'published')), 0)::float8,
       count(*) FILTER (WHERE state = 'published' AND published_at < now() - $1::bigint * interval '1 millisecond')
FROM job_intents WHERE state IN ('pending', 'published')`

// Stats returns the outbox's backlog; threshold sets PublishedOlderThan.
func (c *Client) Stats(ctx context.Context, threshold time.Duration) (OutboxStats, error) {
	var s OutboxStats
	var oldestPending, oldestPublished float64
	err := c.pool.QueryRow(ctx, outboxStatsSQL, threshold.Milliseconds()).Scan(&s.Pending, &oldestPending, &s.Published, &oldestPublished, &s.PublishedOlderThan)
	s.OldestPending = time.Duration(oldestPending * float64(time.Second))
	s.OldestPublished = time.Duration(oldestPublished * float64(time.Second))
	return s, err
}
