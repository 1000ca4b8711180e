package outbox

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency/internal/asynqkeys"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// Epoch markers make a loss of Redis data visible to every process, whenever it started.
// Before it publishes into a queue, a relay makes sure the queue's hash slot holds a random
// marker (idemq:{<queue>}:epoch) and that Postgres (redis_epochs) has a row for the queue;
// after publishing it checks the marker is still there, else the publishes may be lost
// and it tries again. A reconcile round that checked a queue under a marker records that
// marker (and Redis's run_id) in Postgres. So a marker missing from Redis (a restart
// without persistence, FLUSHALL, a failover to a replica without it), a marker other than
// Postgres's, or another run_id means the queue's tasks may be gone: the reconciler checks
// the queue's published intents at once instead of after the grace period.

// epochKey is where a queue's epoch marker lives, in the queue's hash slot.
func epochKey(queue string) string { return "idemq:{" + queue + "}:epoch" }

// errEpochChanged: Redis lost a queue's marker while a publish or a round was under way.
var errEpochChanged = errors.New("outbox: Redis lost data meanwhile (epoch marker changed)")

// newEpoch returns a random marker (crypto/rand, 128 bits).
func newEpoch() string { return rand.Text() }

// markEpochs readies queues for publishing, in one round trip: each is registered in
// asynq's set of queues (asynq's client does that only on its first enqueue to a queue,
// so after Redis restarted empty a long-lived client would never register it again, and
// asynq's Inspector — the dashboard, the queue metrics — would answer "queue not found"),
// and its epoch marker is returned, set anew where Redis has none.
func (c *Client) markEpochs(ctx context.Context, queues []string) (map[string]string, error) {
	if len(queues) == 0 {
		return map[string]string{}, nil
	}
	gets := make([]*redis.StringCmd, len(queues))
	_, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		members := make([]any, len(queues))
		for i, q := range queues {
			members[i] = q
		}
		p.SAdd(ctx, asynqkeys.AllQueues, members...)
		for i, q := range queues {
			p.SetNX(ctx, epochKey(q), newEpoch(), 0)
			gets[i] = p.Get(ctx, epochKey(q))
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("outbox: epoch markers: %w", err)
	}
	marks := make(map[string]string, len(queues))
	for i, q := range queues {
		marks[q] = gets[i].Val()
	}
	return marks, nil
}

// queuesOf returns the distinct queues of batch, in order of appearance.
func queuesOf(batch []intentRow) []string {
	var queues []string
	for _, r := range batch {
		if !slices.Contains(queues, r.spec.Queue) {
			queues = append(queues, r.spec.Queue)
		}
	}
	return queues
}

// ensureEpochs makes sure Postgres has an epoch row for each queue of marks (once per
// queue and Client): a queue's tasks are published only once that row exists, so the
// reconciler knows to watch the queue.
func (c *Client) ensureEpochs(ctx context.Context, marks map[string]string) error {
	for q, m := range marks {
		if _, ok := c.epochQueues.Load(q); ok {
			continue
		}
		if err := store.EnsureEpoch(ctx, c.pool, q, m); err != nil {
			return fmt.Errorf("outbox: record epoch of queue %s: %w", q, err)
		}
		c.epochQueues.Store(q, true)
	}
	return nil
}

// epochsUnchanged reports whether Redis still holds every marker of marks.
func (c *Client) epochsUnchanged(ctx context.Context, marks map[string]string) (bool, error) {
	queues := slices.Sorted(maps.Keys(marks))
	gets := make([]*redis.StringCmd, len(queues))
	_, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, q := range queues {
			gets[i] = p.Get(ctx, epochKey(q))
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return false, fmt.Errorf("outbox: epoch markers: %w", err)
	}
	for i, q := range queues {
		if gets[i].Val() != marks[q] {
			return false, nil
		}
	}
	return true, nil
}

// epochLoss is a queue whose Redis may have lost tasks since a round last checked it.
type epochLoss struct {
	Queue  string
	Reason string // "marker missing", "marker changed", "run_id changed"
}

// lostQueues compares, for every queue with an epoch row, the marker in Redis and Redis's
// run_id with what Postgres recorded, and returns the queues that may have lost tasks and
// the run_id read ("" when Redis does not tell it). A run_id seen for the first time is
// only recorded.
func (c *Client) lostQueues(ctx context.Context) ([]epochLoss, string, error) {
	recorded, err := store.Epochs(ctx, c.pool)
	if err != nil {
		return nil, "", fmt.Errorf("outbox: read epochs: %w", err)
	}
	if len(recorded) == 0 {
		return nil, "", nil
	}
	var info *redis.StringCmd
	gets := make([]*redis.StringCmd, len(recorded))
	// On a cluster each node has a run_id of its own, and INFO goes to any of them: only
	// the markers tell a node that lost its data there.
	_, cluster := c.rdb.(*redis.ClusterClient)
	// Errors are read per command: a missing marker answers redis.Nil, and a Redis that
	// refuses INFO only hides its run_id.
	c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		if !cluster {
			info = p.Info(ctx, "server")
		}
		for i, r := range recorded {
			gets[i] = p.Get(ctx, epochKey(r.Queue))
		}
		return nil
	})
	runID := ""
	if info != nil {
		runID = parseRunID(info.Val())
	}
	var lost []epochLoss
	for i, r := range recorded {
		switch cur := gets[i].Val(); {
		case gets[i].Err() != nil && !errors.Is(gets[i].Err(), redis.Nil):
			return nil, "", fmt.Errorf("outbox: read epoch marker of %s: %w", r.Queue, gets[i].Err())
		case cur == "":
			lost = append(lost, epochLoss{r.Queue, "marker missing"})
		case cur != r.Epoch:
			lost = append(lost, epochLoss{r.Queue, "marker changed"})
		case runID != "" && r.RedisRunID != "" && runID != r.RedisRunID:
			lost = append(lost, epochLoss{r.Queue, "run_id changed"})
		case runID != "" && r.RedisRunID == "":
			if err := store.SettleEpoch(ctx, c.pool, store.Epoch{Queue: r.Queue, Epoch: r.Epoch, RedisRunID: runID}); err != nil {
				return nil, "", fmt.Errorf("outbox: record run_id: %w", err)
			}
		}
	}
	return lost, runID, nil
}

// settleEpochs records that a round checked each queue of marks under its marker and
// runID.
func (c *Client) settleEpochs(ctx context.Context, marks map[string]string, runID string) error {
	for q, m := range marks {
		if err := store.SettleEpoch(ctx, c.pool, store.Epoch{Queue: q, Epoch: m, RedisRunID: runID}); err != nil {
			return fmt.Errorf("outbox: record epoch of queue %s: %w", q, err)
		}
	}
	return nil
}

// parseRunID reads run_id from the answer to INFO server; "" when it is not there.
func parseRunID(info string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "run_id:"); ok {
			return v
		}
	}
	return ""
}

// repairEmptyQueue undoes what earlier releases did when Enqueue published a Spec without
// a queue: they registered the queue "" with asynq (whose Inspector, and so the dashboard,
// then fails for every queue), recorded an epoch row (and a marker) for it, and left
// DefaultQueue, where the task went, without either. When Redis or Postgres still holds
// the queue "", DefaultQueue is marked first (markEpochs, EnsureEpoch), then "" is
// removed from both, so that a process stopping midway leaves something to repair on the
// next round. Every step is idempotent and safe on every replica at once; a round where
// neither holds "" costs one round trip to each.
func (c *Client) repairEmptyQueue(ctx context.Context) error {
	var member *redis.BoolCmd
	var marker *redis.IntCmd
	if _, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		member = p.SIsMember(ctx, asynqkeys.AllQueues, "")
		marker = p.Exists(ctx, epochKey(""))
		return nil
	}); err != nil {
		return fmt.Errorf("outbox: look for the queue \"\": %w", err)
	}
	row, err := store.HasEpoch(ctx, c.pool, "")
	if err != nil {
		return fmt.Errorf("outbox: look for the queue \"\": %w", err)
	}
	if !member.Val() && marker.Val() == 0 && !row {
		return nil
	}
	marks, err := c.markEpochs(ctx, []string{DefaultQueue})
	if err != nil {
		return err
	}
	if err := store.EnsureEpoch(ctx, c.pool, DefaultQueue, marks[DefaultQueue]); err != nil {
		return fmt.Errorf("outbox: record epoch of queue %s: %w", DefaultQueue, err)
	}
	c.epochQueues.Store(DefaultQueue, true)
	if err := store.DeleteEpoch(ctx, c.pool, ""); err != nil {
		return fmt.Errorf("outbox: remove the queue \"\": %w", err)
	}
	if _, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.SRem(ctx, asynqkeys.AllQueues, "")
		p.Del(ctx, epochKey(""))
		return nil
	}); err != nil {
		return fmt.Errorf("outbox: remove the queue \"\": %w", err)
	}
	c.log.Info("removed the queue \"\" that an earlier release registered; marked queue default instead")
	return nil
}
