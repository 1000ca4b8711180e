//go:build faults

package faults

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"syscall"
	"time"

	"github.com/idemq/idemq/internal/localserver"
)

// The nemesis' fault kinds.
const (
	faultKillWorker   = "kill_worker"        // SIGKILL a worker, restart it
	faultStopWorker   = "stop_worker"        // SIGSTOP a worker past its lease, duplicates for its keys, SIGCONT
	faultTermWorker   = "term_worker"        // SIGTERM a worker (graceful drain), restart it
	faultKillRedis    = "kill_redis"         // SIGKILL Redis, restart it
	faultStopPostgres = "stop_postgres"      // immediate shutdown of Postgres, restart it
	faultTerminate    = "terminate_backends" // pg_terminate_backend on the workers' connections
	faultReboot       = "reboot"             // SIGKILL Redis, every worker and every scheduler at once (a node's reboot), restart them
	// The scheduler faults (in runs with schedulers only).
	faultKillScheduler    = "kill_scheduler"    // SIGKILL a scheduler, restart it
	faultStopScheduler    = "stop_scheduler"    // SIGSTOP a scheduler for 2-5 s (ticks pass), SIGCONT
	faultRestartScheduler = "restart_scheduler" // SIGTERM a scheduler, start it again
	// faultPromote SIGKILLs the Postgres primary, promotes its synchronous standby, and
	// 1-3 s later rebuilds the dead node as the new primary's synchronous standby (with a
	// standby only).
	faultPromote = "promote_postgres"
)

var allFaults = []string{faultKillWorker, faultStopWorker, faultTermWorker, faultKillRedis, faultStopPostgres, faultTerminate, faultReboot}

// schedulerFaults are the scheduler kinds.
var schedulerFaults = []string{faultKillScheduler, faultStopScheduler, faultRestartScheduler}

// faultKinds are the kinds the nemesis draws from: allFaults, the scheduler kinds when the
// run has schedulers, and promotions when Postgres has a standby. Without either the list
// is allFaults itself, so that a seed replays the runs it made before they existed.
func (c *cluster) faultKinds() []string {
	kinds := allFaults
	if len(c.schedulers) > 0 {
		kinds = append(slices.Clone(kinds), schedulerFaults...)
	}
	if c.standby != nil {
		kinds = append(slices.Clone(kinds), faultPromote)
	}
	return kinds
}

// runNemesis injects faults for d: first every kind once in a seeded order, then kinds at
// random, with random gaps. It leaves everything running.
func (c *cluster) runNemesis(ctx context.Context, seed uint64, d time.Duration) {
	rng := rand.New(rand.NewPCG(seed, 2))
	kinds := c.faultKinds()
	order := slices.Clone(kinds)
	rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
	end := time.Now().Add(d)
	for n := 0; time.Now().Before(end) && ctx.Err() == nil; n++ {
		gap := time.Duration(2000+rng.IntN(4000)) * time.Millisecond
		select {
		case <-time.After(gap):
		case <-ctx.Done():
			return
		}
		kind := kinds[rng.IntN(len(kinds))]
		if n < len(order) {
			kind = order[n]
		}
		c.inject(ctx, rng, kind)
	}
}

func (c *cluster) inject(ctx context.Context, rng *rand.Rand, kind string) {
	pause := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(rng.Int64N(int64(hi-lo))) }
	w := c.workers[rng.IntN(len(c.workers))]
	switch kind {
	case faultKillWorker:
		w.scrape()
		done := w.signal(syscall.SIGKILL, true)
		if done == nil {
			return
		}
		<-done
		t0 := time.Now()
		c.hist.nemesis(kind, w.name)
		go c.trackHeld(t0)
		time.Sleep(pause(500*time.Millisecond, 2*time.Second))
		c.startWorker(w)

	case faultStopWorker:
		// Stop a worker that holds charges or checkouts: try the workers in turn (each
		// stopped for about lease/3 + 1.3 s to see whose leases stop moving) until one does.
		var held []string
		var t0 time.Time
		for _, i := range rng.Perm(len(c.workers)) {
			w = c.workers[i]
			snap, _ := c.inProgressLeased(ctx)
			if w.signal(syscall.SIGSTOP, false) == nil {
				continue
			}
			t0 = time.Now()
			if held = c.heldBy(ctx, snap); len(held) > 0 {
				break
			}
			w.signal(syscall.SIGCONT, false)
		}
		if len(held) == 0 {
			c.hist.note(kind, w.name, "no worker held a charge or checkout in progress; nothing stopped")
			return
		}
		stopFor := pause(lease+2*time.Second, lease+4*time.Second)
		// A duplicate delivery for each key the stopped worker holds, so that another
		// worker takes it over once the lease has ended, while this one is still stopped.
		sent := 0
		for _, k := range held {
			s, err := c.specFor(ctx, k)
			if err == nil && c.enqueueDup(ctx, s, fmt.Sprintf("%s#stop%d", k, t0.UnixMilli())) == nil {
				sent++
			}
		}
		c.hist.add(func(h *history) {
			h.stopDups += sent
			h.held = append(h.held, heldKeys{at: t0, keys: held})
		})
		c.hist.note(kind, w.name, fmt.Sprintf("stopped %s; held %s; %d duplicates sent", stopFor.Round(100*time.Millisecond), fmtKeys(held), sent))
		time.Sleep(stopFor - time.Since(t0))
		w.signal(syscall.SIGCONT, false)

	case faultTermWorker:
		w.scrape()
		done := w.signal(syscall.SIGTERM, true)
		if done == nil {
			return
		}
		c.hist.nemesis(kind, w.name)
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			w.signal(syscall.SIGKILL, true)
			<-done
			c.hist.note("term_timeout", w.name, "did not exit within 20 s of SIGTERM; killed")
		}
		c.startWorker(w)

	case faultKillScheduler, faultStopScheduler, faultRestartScheduler:
		c.injectScheduler(rng, kind, c.schedulers[rng.IntN(len(c.schedulers))])

	case faultKillRedis:
		if c.sg != nil {
			c.failover(ctx, kind, pause(time.Second, 3*time.Second))
			return
		}
		c.redisUp.Store(false)
		if err := c.rd.Kill(); err != nil {
			c.t.Logf("kill redis: %v", err)
		}
		c.hist.nemesis(kind, "redis")
		time.Sleep(pause(time.Second, 3*time.Second))
		if err := c.rd.Start(); err != nil {
			c.t.Errorf("restart redis: %v", err)
			return
		}
		c.redisUp.Store(true)

	case faultReboot:
		// No process that saw Redis before survives to notice that it came back empty.
		c.redisUp.Store(false)
		var dones []chan struct{}
		for _, w := range append(slices.Clone(c.workers), c.schedulers...) {
			w.scrape()
			if done := w.signal(syscall.SIGKILL, true); done != nil {
				dones = append(dones, done)
			}
		}
		if c.sg != nil {
			c.failover(ctx, "failover", 0)
		} else if err := c.rd.Kill(); err != nil {
			c.t.Logf("kill redis: %v", err)
		}
		for _, done := range dones {
			<-done
		}
		t0 := time.Now()
		c.hist.nemesis(kind, "redis, every worker and scheduler")
		go c.trackHeld(t0)
		time.Sleep(pause(time.Second, 3*time.Second))
		if !c.redisUp.Load() {
			if err := c.rd.Start(); err != nil {
				c.t.Errorf("restart redis: %v", err)
				return
			}
			c.redisUp.Store(true)
		}
		for _, w := range c.workers {
			c.startWorker(w)
		}
		for _, s := range c.schedulers {
			c.startScheduler(s)
		}
		go c.trackLost(ctx, time.Now())

	case faultStopPostgres:
		// With a standby: the primary stops, and the standby keeps retrying its stream.
		c.pgUp.Store(false)
		if err := c.pg.StopImmediate(); err != nil {
			c.t.Logf("stop postgres: %v", err)
		}
		c.hist.nemesis(kind, "postgres")
		time.Sleep(pause(time.Second, 3*time.Second))
		if err := c.pg.Start(); err != nil {
			c.t.Errorf("restart postgres: %v", err)
			return
		}
		c.pgUp.Store(true)

	case faultPromote:
		c.promote(ctx, kind, pause(time.Second, 3*time.Second))

	case faultTerminate:
		var n int
		err := c.pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE application_name = 'idemq-worker' AND pid <> pg_backend_pid()`).Scan(&n)
		note := fmt.Sprintf("%d connections", n)
		if err != nil {
			note = err.Error()
		}
		c.hist.note(kind, "workers", note)
	}
}

// injectScheduler kills, freezes or restarts the scheduler s. While it is down the other
// replica enqueues the ticks; when both are (a reboot, or two faults in a row), the first
// to start again catches the missed ticks up.
func (c *cluster) injectScheduler(rng *rand.Rand, kind string, s *worker) {
	switch kind {
	case faultKillScheduler:
		s.scrape()
		done := s.signal(syscall.SIGKILL, true)
		if done == nil {
			return
		}
		<-done
		c.hist.nemesis(kind, s.name)
		time.Sleep(time.Duration(500+rng.IntN(3000)) * time.Millisecond)
		c.startScheduler(s)
	case faultStopScheduler:
		stopFor := time.Duration(2000+rng.IntN(3000)) * time.Millisecond
		if s.signal(syscall.SIGSTOP, false) == nil {
			return
		}
		c.hist.note(kind, s.name, fmt.Sprintf("stopped %s", stopFor.Round(100*time.Millisecond)))
		time.Sleep(stopFor)
		s.signal(syscall.SIGCONT, false)
	case faultRestartScheduler:
		s.scrape()
		done := s.signal(syscall.SIGTERM, true)
		if done == nil {
			return
		}
		c.hist.nemesis(kind, s.name)
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			s.signal(syscall.SIGKILL, true)
			<-done
			c.hist.note("term_timeout", s.name, "did not exit within 20 s of SIGTERM; killed")
		}
		c.startScheduler(s)
	}
}

// trackLost records how long after since the accepted keys whose task Redis lost are all
// back in Redis (republished), and how many were missing.
func (c *cluster) trackLost(ctx context.Context, since time.Time) {
	most := 0
	for time.Since(since) < 2*time.Minute && ctx.Err() == nil {
		left, err := c.unsettled(ctx)
		if err == nil {
			most = max(most, left[leftMissing])
			if left[leftMissing] == 0 {
				c.hist.add(func(h *history) { h.lost = append(h.lost, lostTasks{n: most, back: time.Since(since)}) })
				c.hist.note("lost_back", "", fmt.Sprintf("%d tasks Redis lost were back after %s", most, time.Since(since).Round(100*time.Millisecond)))
				return
			}
		}
		time.Sleep(250 * time.Millisecond)
	}
	c.hist.add(func(h *history) { h.lost = append(h.lost, lostTasks{n: most, back: -1}) })
}

// failover SIGKILLs the Sentinels' master, waits until they promote the replica, and
// after down (when > 0) starts the dead node again, which the Sentinels make a replica of
// the new master; with down 0 it leaves the node dead (the caller or heal starts it).
func (c *cluster) failover(ctx context.Context, kind string, down time.Duration) {
	old, err := c.sg.CurrentMaster(ctx)
	if err != nil {
		c.hist.note(kind, "redis", "no master known: "+err.Error())
		return
	}
	for _, r := range []*localserver.Redis{c.sg.Master, c.sg.Replica} {
		if r.Addr == old {
			c.rd = r
		}
	}
	c.redisUp.Store(false)
	t0 := time.Now()
	if err := c.rd.Kill(); err != nil {
		c.t.Logf("kill redis master: %v", err)
	}
	note := "no replica promoted within 30 s"
	for time.Since(t0) < 30*time.Second && ctx.Err() == nil {
		if m, err := c.sg.CurrentMaster(ctx); err == nil && m != old {
			note = fmt.Sprintf("master %s killed; %s promoted after %s", old, m, time.Since(t0).Round(10*time.Millisecond))
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	c.hist.note(kind, "redis master", note)
	if down == 0 {
		return
	}
	time.Sleep(down)
	if err := c.rd.Start(); err != nil {
		c.t.Errorf("restart the old master: %v", err)
		return
	}
	c.redisUp.Store(true)
}

// promote SIGKILLs the Postgres primary, promotes the standby in its place and notes how
// long after the kill the standby was promoted and a write through the multi-host URL
// first succeeded; after down it rebuilds the dead node, at its own port, as a synchronous
// standby of the new primary (which commits locally only until then).
func (c *cluster) promote(ctx context.Context, kind string, down time.Duration) {
	if !c.standbyUp.Load() {
		c.hist.note(kind, "postgres", "no standby to promote; nothing done")
		return
	}
	old, next := c.pg, c.standby
	c.pgUp.Store(false)
	c.standbyUp.Store(false)
	t0 := time.Now()
	if err := old.Kill(); err != nil {
		c.t.Logf("kill postgres primary: %v", err)
	}
	if err := next.Promote(); err != nil {
		c.t.Errorf("promote the postgres standby: %v\n%s", err, next.Log())
		if err := old.Start(); err != nil { // the standby follows it again
			c.t.Errorf("restart the postgres primary: %v", err)
			return
		}
		c.pgUp.Store(true)
		c.standbyUp.Store(true)
		return
	}
	promoted := time.Since(t0)
	c.pg, c.standby = next, old
	c.pgUp.Store(true)
	writable, err := localserver.WaitWritable(ctx, c.dbURL, t0, 30*time.Second)
	if err != nil {
		writable = -1 // the report fails the run
	}
	c.hist.add(func(h *history) {
		h.promotions = append(h.promotions, promotion{promoted: promoted, writable: writable})
	})
	c.hist.note(kind, "postgres primary", fmt.Sprintf("primary :%d killed; standby :%d promoted after %s, writable through the multi-host URL after %s",
		old.Port(), next.Port(), promoted.Round(time.Millisecond), writable.Round(time.Millisecond)))

	time.Sleep(down)
	t1 := time.Now()
	if err := old.RebuildAsStandby(c.pg, true); err != nil {
		c.t.Errorf("rebuild the old postgres primary as a standby: %v", err)
		return
	}
	c.standbyUp.Store(true)
	c.hist.note("standby_rebuilt", "postgres standby", fmt.Sprintf(":%d a synchronous standby of :%d again after %s (down %s)",
		old.Port(), c.pg.Port(), time.Since(t1).Round(time.Millisecond), down.Round(100*time.Millisecond)))
}

// heal makes sure every server and worker runs (none stopped), with a standby: a primary
// and a synchronous standby.
func (c *cluster) heal() {
	if !c.redisUp.Load() {
		if err := c.rd.Start(); err != nil {
			c.t.Errorf("heal: start redis: %v", err)
		}
		c.redisUp.Store(true)
	}
	if !c.pgUp.Load() {
		if err := c.pg.Start(); err != nil {
			c.t.Errorf("heal: start postgres: %v", err)
		}
		c.pgUp.Store(true)
	}
	if c.standby != nil && !c.standbyUp.Load() {
		if err := c.standby.RebuildAsStandby(c.pg, true); err != nil {
			c.t.Errorf("heal: rebuild the postgres standby: %v", err)
		} else {
			c.standbyUp.Store(true)
		}
	}
	for _, w := range append(slices.Clone(c.workers), c.schedulers...) {
		w.signal(syscall.SIGCONT, false)
	}
}
