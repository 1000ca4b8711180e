// Package process registers a long-running idemq process (worker, api, scheduler) in
// idemq_processes, with its release and schema version, so that `idemq migrate` can tell
// which releases are alive before it applies a contract step (docs/releases.md).
//
//	reg := process.Start(ctx, pool, process.RoleWorker, log)
//	defer reg.Stop()
//
// Registration is best effort: a process that cannot reach Postgres keeps running and
// logs it; it registers as soon as it can.
package process

import (
	"context"
	"crypto/rand"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/internal/release"
)

// The roles of the processes that register.
const (
	RoleWorker    = "worker"
	RoleAPI       = "api"
	RoleScheduler = "scheduler"
)

const (
	// HeartbeatInterval is how often a registered process refreshes its row.
	HeartbeatInterval = 15 * time.Second
	// PruneAfter is how long a row may go without a heartbeat before whoever heartbeats
	// deletes it (a process that was killed never deletes its own).
	PruneAfter = time.Hour
	// statementTimeout bounds each write, so a slow database never holds a heartbeat up
	// longer than one interval.
	statementTimeout = 5 * time.Second
)

// heartbeat registers the process, or refreshes its heartbeat when its row is there (one
// statement: a row pruned while the process could not reach Postgres comes back), and
// deletes the rows of processes silent for longer than PruneAfter.
const heartbeat = `WITH pruned AS (
	DELETE FROM idemq_processes WHERE heartbeat_at < now() - make_interval(secs => $9) AND id <> $1
)
INSERT INTO idemq_processes AS p (id, role, version, commit, schema_version, host, pid, started_at, heartbeat_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now())
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()`

const unregister = `DELETE FROM idemq_processes WHERE id = $1`

// A Registration is one process's row; Stop deletes it.
type Registration struct {
	ID      string
	Role    string
	Build   release.Build
	Host    string
	PID     int
	started time.Time

	pool     *pgxpool.Pool
	log      *slog.Logger
	interval time.Duration
	cancel   context.CancelFunc
	done     chan struct{}
	stop     sync.Once
}

// Options tune a registration; nil means the defaults.
type Options struct {
	// Interval between heartbeats; default HeartbeatInterval.
	Interval time.Duration
}

// Start registers this process under role and heartbeats until ctx ends or Stop is
// called. It returns at once: the first write runs in the background, and a failed one is
// logged and retried at the next heartbeat.
func Start(ctx context.Context, pool *pgxpool.Pool, role string, log *slog.Logger, opts *Options) *Registration {
	host, _ := os.Hostname()
	r := &Registration{
		ID:       newID(),
		Role:     role,
		Build:    release.Current(),
		Host:     host,
		PID:      os.Getpid(),
		started:  time.Now(),
		pool:     pool,
		log:      log,
		interval: HeartbeatInterval,
		done:     make(chan struct{}),
	}
	if opts != nil && opts.Interval > 0 {
		r.interval = opts.Interval
	}
	ctx, r.cancel = context.WithCancel(ctx)
	go r.run(ctx)
	return r
}

func (r *Registration) run(ctx context.Context) {
	defer close(r.done)
	t := time.NewTicker(r.interval)
	defer t.Stop()
	failing := false
	for {
		err := r.beat(ctx)
		switch {
		case err != nil && ctx.Err() != nil:
			return
		case err != nil && !failing:
			r.log.Warn("cannot register this process in idemq_processes (running on; retrying every heartbeat)",
				"err", err, "role", r.Role, "version", r.Build.Version)
			failing = true
		case err == nil && failing:
			r.log.Info("registered this process in idemq_processes again", "role", r.Role)
			failing = false
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (r *Registration) beat(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, statementTimeout)
	defer cancel()
	_, err := r.pool.Exec(ctx, heartbeat, r.ID, r.Role, r.Build.Version, r.Build.Revision(), r.Build.Schema,
		r.Host, r.PID, r.started, PruneAfter.Seconds())
	return err
}

// Stop ends the heartbeats and deletes the process's row (within 5 s; a failure is
// logged: the row stops counting as alive once its heartbeat is old). Safe to call more
// than once.
func (r *Registration) Stop() {
	r.stop.Do(func() {
		r.cancel()
		<-r.done
		ctx, cancel := context.WithTimeout(context.Background(), statementTimeout)
		defer cancel()
		if _, err := r.pool.Exec(ctx, unregister, r.ID); err != nil {
			r.log.Warn("cannot delete this process's row from idemq_processes", "err", err, "id", r.ID)
		}
	})
}

// newID is a random (version 4) UUID.
func newID() string {
	var b [16]byte
	rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}
