package localserver

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

// Server is a private Postgres or Redis server on a free loopback port, started from the
// installed binaries. Close kills it and removes its files. Its methods are safe to call
// from several goroutines.
type Server struct {
	p          *process
	port       int
	dir        string
	ready      func() error
	stopSignal syscall.Signal
	// settle, if set, waits until what a killed server left behind lets it start again.
	settle func()
}

// Close kills the server and removes its directory.
func (s *Server) Close() error {
	err := s.p.stop(syscall.SIGKILL, true, 10*time.Second)
	os.RemoveAll(s.dir)
	return err
}

// Port returns the loopback TCP port the server listens on.
func (s *Server) Port() int { return s.port }

// Kill sends SIGKILL to the server and its children, as a machine crash would, and waits
// for them to exit.
func (s *Server) Kill() error { return s.p.stop(syscall.SIGKILL, true, 10*time.Second) }

// Stop shuts the server down cleanly (Postgres: fast shutdown, SIGINT, which does not wait
// for clients to disconnect; Redis: SIGTERM, which syncs the AOF) and waits for it to exit.
func (s *Server) Stop() error { return s.p.stop(s.stopSignal, false, 30*time.Second) }

// Start starts a stopped or killed server again on the same port and data, and waits until
// it answers.
func (s *Server) Start() error {
	if s.settle != nil {
		s.settle()
	}
	if err := s.p.start(); err != nil {
		return err
	}
	if err := waitFor(30*time.Second, s.ready); err != nil {
		return fmt.Errorf("%s did not come up: %w\n%s", s.p.name, err, s.p.logTail())
	}
	return nil
}

// Pause stops the server's processes with SIGSTOP; connections stay open and hang.
func (s *Server) Pause() error { return s.p.signal(syscall.SIGSTOP) }

// Resume continues a paused server with SIGCONT.
func (s *Server) Resume() error { return s.p.signal(syscall.SIGCONT) }

// Log returns the end of the server's log, for failure messages.
func (s *Server) Log() string { return s.p.logTail() }

func (s *Server) startOrClose() error {
	if err := s.Start(); err != nil {
		s.Close()
		return err
	}
	return nil
}

// Postgres is a private Postgres server (fsync on). Its cluster is in data/ under the
// server's directory.
type Postgres struct {
	Server
	// URL connects as the superuser "postgres" to database "postgres", with no password.
	URL string

	settings []string // "name=value" over the defaults; a standby inherits them
}

// StopImmediate stops Postgres with an immediate shutdown (pg_ctl stop -m immediate):
// no checkpoint, recovery at the next start.
func (s *Postgres) StopImmediate() error {
	return s.p.stop(syscall.SIGQUIT, false, 30*time.Second)
}

// StartPostgres initialises a fresh cluster in a temporary directory and starts it on a
// free loopback port, with settings ("name=value") over its own. When run as root, the
// server runs as the postgres user (initdb and postgres refuse root). The server can be
// the primary of StartStandby as it is: Postgres's defaults stream WAL (wal_level=replica,
// max_wal_senders=10), and initdb --auth=trust lets any local user replicate over
// 127.0.0.1.
func StartPostgres(settings ...string) (*Postgres, error) {
	initdb, err := pgBinary("initdb")
	if err != nil {
		return nil, err
	}
	cred, err := serviceUser("postgres")
	if err != nil {
		return nil, err
	}
	root, err := ownedTempDir("idemq-pg-", cred)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(initdb, "-D", filepath.Join(root, "data"), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		os.RemoveAll(root)
		return nil, fmt.Errorf("initdb: %w\n%s", err, out)
	}
	s, err := newPostgres(root, cred, settings)
	if err != nil {
		os.RemoveAll(root)
		return nil, err
	}
	return s, s.startOrClose()
}

// newPostgres prepares, without starting it, a server for the cluster in root/data on a
// free loopback port.
func newPostgres(root string, cred *syscall.Credential, settings []string) (*Postgres, error) {
	postgres, err := pgBinary("postgres")
	if err != nil {
		return nil, err
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	s := &Postgres{URL: fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port), settings: settings}
	s.port, s.dir, s.stopSignal = port, root, syscall.SIGINT
	s.p = &process{
		name: "private postgres", dir: root, log: filepath.Join(root, "postgres.log"), cred: cred,
		argv: []string{postgres, "-D", s.dataDir(), "-p", strconv.Itoa(port), "-k", root,
			"-c", "listen_addresses=127.0.0.1", "-c", "fsync=on", "-c", "max_connections=100",
			"-c", "shared_buffers=32MB", "-c", "logging_collector=off",
			// A standby that has lost its primary retries the stream every
			// wal_retrieve_retry_interval, and a promotion asked for meanwhile waits for
			// the retry: 100 ms instead of the default 5 s. Any server may become a
			// standby (RebuildAsStandby); a primary ignores it.
			"-c", "wal_retrieve_retry_interval=100ms"},
	}
	for _, kv := range settings {
		s.p.argv = append(s.p.argv, "-c", kv)
	}
	s.settle = s.waitSharedMemoryFree
	s.ready = func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, s.URL)
		if err != nil {
			return err
		}
		return conn.Close(ctx)
	}
	return s, nil
}

// waitSharedMemoryFree waits (up to 15 s) until no process is attached to the shared
// memory segment a killed postmaster left (named in its postmaster.pid): its backends exit
// on their own once they notice the postmaster is gone, and a Postgres started while one is
// still attached refuses to run ("pre-existing shared memory block is still in use").
func (s *Postgres) waitSharedMemoryFree() {
	pid, err := os.ReadFile(filepath.Join(s.dataDir(), "postmaster.pid"))
	if err != nil {
		return // stopped cleanly, or never started
	}
	lines := strings.Split(string(pid), "\n")
	if len(lines) < 7 {
		return
	}
	f := strings.Fields(lines[6]) // "<shm key> <shm id>"
	if len(f) < 2 {
		return
	}
	id := f[1]
	waitFor(15*time.Second, func() error {
		b, err := os.ReadFile("/proc/sysvipc/shm")
		if err != nil {
			return nil // not Linux: nothing to look at
		}
		for _, line := range strings.Split(string(b), "\n") {
			// key shmid perms size cpid lpid nattch ...
			if c := strings.Fields(line); len(c) > 6 && c[1] == id && c[6] != "0" {
				return fmt.Errorf("shared memory %s still attached by %s processes", id, c[6])
			}
		}
		return nil
	})
}

// dataDir is the server's cluster directory.
func (s *Postgres) dataDir() string { return filepath.Join(s.dir, "data") }

// pgBinary finds a Postgres server binary on PATH or in Debian's versioned directories.
func pgBinary(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/" + name)
	if len(matches) > 0 {
		return matches[len(matches)-1], nil
	}
	return "", fmt.Errorf("%s not found on PATH or in /usr/lib/postgresql/*/bin (apt-get install -y postgresql)", name)
}

// Persistence is how a private Redis keeps its data across restarts.
type Persistence int

const (
	// PersistNone keeps nothing: a restart empties the server.
	PersistNone Persistence = iota
	// PersistAOFEverySec appends every write and fsyncs once a second.
	PersistAOFEverySec
	// PersistAOFAlways appends and fsyncs every write before answering.
	PersistAOFAlways
)

// Redis is a private Redis server.
type Redis struct {
	Server
	// URL connects to database 0.
	URL string
	// Addr is host:port.
	Addr string
}

// StartRedis starts redis-server in a temporary directory on a free loopback port with the
// given persistence and extra arguments (such as "--replicaof", host, port).
func StartRedis(mode Persistence, extra ...string) (*Redis, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server not found on PATH (apt-get install -y redis-server)")
	}
	dir, port, err := dirAndPort("idemq-redis-")
	if err != nil {
		return nil, err
	}
	argv := []string{bin, "--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--dir", dir,
		"--save", "", "--daemonize", "no", "--maxmemory-policy", "noeviction"}
	switch mode {
	case PersistNone:
		argv = append(argv, "--appendonly", "no")
	case PersistAOFEverySec:
		argv = append(argv, "--appendonly", "yes", "--appendfsync", "everysec")
	case PersistAOFAlways:
		argv = append(argv, "--appendonly", "yes", "--appendfsync", "always")
	}
	argv = append(argv, extra...)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	s := &Redis{URL: "redis://" + addr + "/0", Addr: addr}
	s.port, s.dir, s.stopSignal = port, dir, syscall.SIGTERM
	s.p = &process{name: "private redis", dir: dir, log: filepath.Join(dir, "redis.log"), argv: argv}
	s.ready = pinged(addr)
	return s, s.startOrClose()
}

// dirAndPort makes a temporary directory named after prefix and finds a free loopback
// port for a server to run there.
func dirAndPort(prefix string) (string, int, error) {
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		return "", 0, err
	}
	port, err := FreePort()
	if err != nil {
		os.RemoveAll(dir)
		return "", 0, err
	}
	return dir, port, nil
}

// pinged is a readiness check: the Redis server (or Sentinel) at addr answers PING.
func pinged(addr string) func() error {
	return func() error {
		c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: time.Second})
		defer c.Close()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		return c.Ping(ctx).Err()
	}
}
