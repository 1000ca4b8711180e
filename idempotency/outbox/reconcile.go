package outbox

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"

	"github.com/idemq/idemq/idempotency/internal/asynqkeys"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// reconcilePage is how many intents one look-up in Redis covers; a round with a grace
// period checks one page, a round right after Redis lost data checks them all.
const reconcilePage = 1000

// ReconcileStats says what one reconcile round did.
type ReconcileStats struct {
	Archived    int // of those, whose own task asynq archived: settled dead with its last error
	Checked     int // published intents older than the grace period, looked up in Redis
	Missing     int // of those, missing from Redis (no queue, no task, an orphaned hash, or another task under the TaskID)
	Republished int // republished under a new TaskID
}

// Reconcile republishes published intents older than grace whose task Redis no longer
// has (or holds another task under its TaskID, or holds as completed although the intent
// is not settled: a completion Postgres lost), under TaskID key#r<generation> (never colliding with an orphaned or archived
// task; the ledger dedups across generations). With a grace period it checks the 1000
// oldest such intents; with none (grace 0, as after Redis lost data) it checks them all.
// It never settles an intent done: only a delivery of the intent's own task does (see
// idempotency.Request.TaskID), so a key that another producer's task completed is
// republished, and its delivery, answered from the ledger, settles the intent then. An
// intent whose own task asynq archived (its retries ran out) is settled dead with the
// task's last error: no delivery will settle it.
// It republishes at most Config.RepublishPerSecond per second. If Redis loses data
// during the round (a queue's epoch marker changes), the round runs again without grace.
// Each round first removes the queue "" that earlier releases registered for a Spec
// without a queue (see repairEmptyQueue).
// Safe for concurrent use.
func (c *Client) Reconcile(ctx context.Context, grace time.Duration) (ReconcileStats, error) {
	if err := c.repairEmptyQueue(ctx); err != nil {
		return ReconcileStats{}, err
	}
	st, _, err := c.reconcile(ctx, grace, nil)
	return st, err
}

// reconcile is Reconcile, only for queues when it is not nil. It returns the epoch
// markers the queues it checked had for the whole round.
func (c *Client) reconcile(ctx context.Context, grace time.Duration, queues []string) (ReconcileStats, map[string]string, error) {
	var st ReconcileStats
	limiter := rate.NewLimiter(rate.Limit(c.cfg.RepublishPerSecond), 1)
	for attempt := 1; ; attempt++ {
		marks, err := c.markEpochs(ctx, queues)
		if err != nil {
			return st, nil, err
		}
		if err := c.reconcileRound(ctx, grace, queues, marks, limiter, &st); err != nil {
			return st, nil, err
		}
		same, err := c.epochsUnchanged(ctx, marks)
		if err != nil {
			return st, nil, err
		}
		if same {
			return st, marks, nil
		}
		if attempt == 3 {
			return st, nil, errEpochChanged
		}
		// What this round republished may be lost again: look again, at everything.
		grace = 0
		c.log.Warn("Redis lost data during a reconcile round; checking again")
	}
}

// reconcileRound checks the intents published before the round's cutoff, page by page,
// and republishes those Redis lacks. It adds the markers of the queues it meets to marks.
func (c *Client) reconcileRound(ctx context.Context, grace time.Duration, queues []string, marks map[string]string,
	limiter *rate.Limiter, st *ReconcileStats) error {
	cutoff, err := store.Cutoff(ctx, c.pool, grace)
	if err != nil {
		return fmt.Errorf("outbox: read the clock: %w", err)
	}
	page := store.StaleParams{Before: cutoff, Limit: reconcilePage, Queues: queues}
	for {
		rows, err := store.StaleIntents(ctx, c.pool, page)
		if err != nil {
			return fmt.Errorf("outbox: list stale intents: %w", err)
		}
		stale := intentRows(rows)
		if len(stale) == 0 {
			return nil
		}
		last := stale[len(stale)-1]
		page.AfterAt, page.AfterKey = last.publishedAt, last.spec.Key
		if err := c.addEpochs(ctx, stale, marks); err != nil {
			return err
		}
		if err := c.republishMissing(ctx, stale, limiter, st); err != nil {
			return err
		}
		if len(stale) < reconcilePage || grace > 0 {
			return nil
		}
	}
}

// addEpochs adds the markers of the batch's queues that marks lacks (registering those
// queues with asynq, before anything is republished into them).
func (c *Client) addEpochs(ctx context.Context, batch []intentRow, marks map[string]string) error {
	fresh := slices.DeleteFunc(queuesOf(batch), func(q string) bool { _, ok := marks[q]; return ok })
	got, err := c.markEpochs(ctx, fresh)
	if err != nil {
		return err
	}
	for q, m := range got {
		marks[q] = m
	}
	return nil
}

// republishMissing republishes the intents of stale whose task Redis lacks.
func (c *Client) republishMissing(ctx context.Context, stale []intentRow, limiter *rate.Limiter, st *ReconcileStats) error {
	st.Checked += len(stale)
	present, err := c.tasksPresent(ctx, stale)
	if err != nil {
		return err
	}
	var missing []intentRow
	for i, r := range stale {
		switch p := present[i]; {
		case p.archived != nil:
			if err := c.settleArchived(ctx, r, p.archived, st); err != nil {
				return err
			}
		case !p.present:
			missing = append(missing, r)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	for _, r := range missing {
		st.Missing++
		if err := limiter.Wait(ctx); err != nil {
			return err
		}
		next := r
		next.gen = r.gen + 1
		gen, err := c.publish(ctx, next)
		if err != nil {
			return fmt.Errorf("outbox: republish %s: %w", r.spec.Key, err)
		}
		recorded, err := store.RecordRepublish(ctx, c.pool, r.spec.Key, r.gen, gen)
		if err != nil {
			return fmt.Errorf("outbox: record republish of %s: %w", r.spec.Key, err)
		}
		if !recorded {
			continue // another reconciler republished it, or it finished meanwhile
		}
		st.Republished++
		c.observe(EventRepublished, r.spec.Type)
		log := c.log.With("task_type", r.spec.Type, "key", r.spec.Key, "task_id", taskID(r.spec.Key, gen))
		if gen >= c.cfg.AlertGeneration {
			c.observe(EventRepublishAlert, r.spec.Type)
			log.Error("job republished again: Redis keeps losing it, or it never completes", "generation", gen)
		} else {
			log.Warn("job missing from Redis; republished", "generation", gen)
		}
	}
	return nil
}

// settleArchived settles r dead: asynq archived its own task, so no delivery will settle
// it (a delivery refused on its last attempt, or whose settle could not be written). An
// operator's rerun republishes it.
func (c *Client) settleArchived(ctx context.Context, r intentRow, info *asynq.TaskInfo, st *ReconcileStats) error {
	reason := "archived: " + info.LastErr
	if len(reason) > 1000 {
		reason = reason[:1000]
	}
	settled, err := store.SettleArchived(ctx, c.pool, r.spec.Key, r.gen, strings.ToValidUTF8(reason, "?"))
	if err != nil {
		return fmt.Errorf("outbox: settle archived %s: %w", r.spec.Key, err)
	}
	if !settled {
		return nil
	}
	st.Archived++
	c.observe(EventArchived, r.spec.Type)
	c.log.Warn("accepted job's task was archived; its intent is dead", "task_type", r.spec.Type, "key", r.spec.Key,
		"task_id", info.ID, "last_error", info.LastErr)
	return nil
}

// taskPresence is what tasksPresent found of an intent's current task.
type taskPresence struct {
	present  bool
	archived *asynq.TaskInfo // the intent's own task, archived by asynq
}

// tasksPresent reports, for each intent, whether Redis holds its current task: a missing
// queue, a missing task hash, an orphaned hash without a message (left by a late result
// write) and another task under the same TaskID (another type or payload) all count as
// absent; the intent's own task archived is reported as such.
func (c *Client) tasksPresent(ctx context.Context, rs []intentRow) ([]taskPresence, error) {
	cmds := make([]*redis.BoolCmd, len(rs))
	_, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, r := range rs {
			cmds[i] = p.HExists(ctx, asynqkeys.Task(r.spec.Queue, taskID(r.spec.Key, r.gen)), "msg")
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("outbox: look up tasks in Redis: %w", err)
	}
	out := make([]taskPresence, len(rs))
	for i, cmd := range cmds {
		if !cmd.Val() {
			continue
		}
		match, info, err := c.lookTask(ctx, rs[i], taskID(rs[i].spec.Key, rs[i].gen))
		if err != nil {
			return nil, fmt.Errorf("outbox: look up tasks in Redis: %w", err)
		}
		// A task asynq completed while its intent is still published lost its
		// completion: idemq's handlers return only after the ledger settled the intent
		// (a completion, or a cached answer), so the commit was lost with the database,
		// as when Postgres fails over to an asynchronous standby. It runs again.
		out[i].present = match == taskIsThisJob
		if out[i].present && info.State == asynq.TaskStateArchived {
			out[i].archived = info
		}
	}
	return out, nil
}

// RunReconciler reconciles every Config.ReconcileEvery with the grace period, and,
// within Config.ProbeEvery of Redis losing a queue's data (its epoch marker is
// missing or changed, or Redis's run_id changed: see the epoch markers), that queue at
// once, without grace, whichever process was watching before. It returns nil when ctx
// ends. Every replica may run it.
func (c *Client) RunReconciler(ctx context.Context) error {
	tick := time.NewTicker(c.cfg.ReconcileEvery)
	defer tick.Stop()
	probe := time.NewTicker(c.cfg.ProbeEvery)
	defer probe.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
			st, err := c.Reconcile(ctx, c.cfg.Grace)
			c.logRound(ctx, st, err)
		case <-probe.C:
			c.reconcileLost(ctx)
		}
	}
}

// reconcileLost reconciles, without grace, the queues whose Redis may have lost tasks,
// and records their epochs once that round is done.
func (c *Client) reconcileLost(ctx context.Context) {
	lost, runID, err := c.lostQueues(ctx)
	if err != nil {
		if ctx.Err() == nil {
			c.log.Debug("epoch probe", "err", err)
		}
		return
	}
	if len(lost) == 0 {
		return
	}
	queues := make([]string, len(lost))
	for i, l := range lost {
		queues[i] = l.Queue
		c.log.Warn("Redis may have lost the queue's tasks; reconciling now", "queue", l.Queue, "reason", l.Reason, "run_id", runID)
	}
	st, marks, err := c.reconcile(ctx, 0, queues)
	c.logRound(ctx, st, err)
	if err != nil {
		return // the markers still differ: the next probe tries again
	}
	if err := c.settleEpochs(ctx, marks, runID); err != nil && ctx.Err() == nil {
		c.log.Warn("reconcile", "err", err)
	}
}

func (c *Client) logRound(ctx context.Context, st ReconcileStats, err error) {
	if err != nil {
		if ctx.Err() == nil {
			c.log.Warn("reconcile", "err", err)
		}
		return
	}
	if st.Missing > 0 || st.Archived > 0 {
		c.log.Info("reconciled", "checked", st.Checked, "missing", st.Missing, "republished", st.Republished, "archived", st.Archived)
	}
}

// Stats is the outbox's backlog, for metrics.
type Stats struct {
	Pending            int
	OldestPending      time.Duration // relay lag
	Published          int           // published, not yet done or dead
	OldestPublished    time.Duration
	PublishedOlderThan int // published longer ago than the threshold asked for
}

// Stats returns the outbox's backlog; threshold sets PublishedOlderThan.
func (c *Client) Stats(ctx context.Context, threshold time.Duration) (Stats, error) {
	s, err := store.ReadOutboxStats(ctx, c.pool, threshold)
	return Stats{Pending: s.Pending, OldestPending: s.OldestPending, Published: s.Published,
		OldestPublished: s.OldestPublished, PublishedOlderThan: s.PublishedOlderThan}, err
}
