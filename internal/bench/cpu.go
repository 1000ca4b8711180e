package bench

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// clockTicks is USER_HZ, the unit of utime and stime in /proc/<pid>/stat: 100 on every
// Linux architecture Go supports.
const clockTicks = 100

// cpuSnap is CPU time (seconds) used so far by the parties of one measurement.
type cpuSnap struct {
	self  float64         // this process (Go: asynq, the middleware, fakepay, the enqueuer)
	redis float64         // the redis-server process, when it runs on this machine
	pg    map[int]float64 // this run's Postgres backends and the WAL writer, checkpointer, bgwriter
}

// cpuProbe knows where to read CPU time from.
type cpuProbe struct {
	redisPID int
	admin    *pgxpool.Pool
	appName  string
}

// newCPUProbe finds redis-server's pid (INFO server) when its /proc entry is readable.
func newCPUProbe(ctx context.Context, rdb *redis.Client, admin *pgxpool.Pool, appName string) *cpuProbe {
	p := &cpuProbe{admin: admin, appName: appName}
	if info, err := rdb.Info(ctx, "server").Result(); err == nil {
		for _, line := range strings.Split(info, "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "process_id:"); ok {
				pid, _ := strconv.Atoi(v)
				if _, err := procCPU(pid); err == nil {
					p.redisPID = pid
				}
			}
		}
	}
	return p
}

// pgQuery lists the Postgres processes counted: this run's connections (by
// application_name) and the processes every commit leans on.
const pgQuery = `SELECT pid FROM pg_stat_activity
	WHERE application_name = $1 OR backend_type IN ('walwriter', 'checkpointer', 'background writer')`

func (p *cpuProbe) snap(ctx context.Context) cpuSnap {
	s := cpuSnap{pg: map[int]float64{}}
	s.self, _ = procCPU(os.Getpid())
	if p.redisPID > 0 {
		s.redis, _ = procCPU(p.redisPID)
	}
	rows, err := p.admin.Query(ctx, pgQuery, p.appName)
	if err != nil {
		return s
	}
	defer rows.Close()
	for rows.Next() {
		var pid int
		if rows.Scan(&pid) == nil {
			if v, err := procCPU(pid); err == nil {
				s.pg[pid] = v
			}
		}
	}
	return s
}

// cpuDelta is CPU seconds used between two snapshots, per party. A Postgres process that
// appeared in between counts from zero; one that ended in between is not counted.
type cpuDelta struct{ self, redis, pg float64 }

func (a cpuSnap) to(b cpuSnap) cpuDelta {
	d := cpuDelta{self: b.self - a.self, redis: b.redis - a.redis}
	for pid, v := range b.pg {
		d.pg += v - a.pg[pid]
	}
	return d
}

// procCPU returns utime+stime of pid, in seconds.
func procCPU(pid int) (float64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name may hold spaces and parentheses: fields start after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("bench: unreadable /proc/%d/stat", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("bench: short /proc/%d/stat", pid)
	}
	// After the name: state(3) ... utime(14) stime(15), i.e. f[11] and f[12].
	u, err1 := strconv.ParseFloat(f[11], 64)
	s, err2 := strconv.ParseFloat(f[12], 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("bench: unreadable /proc/%d/stat", pid)
	}
	return (u + s) / clockTicks, nil
}
