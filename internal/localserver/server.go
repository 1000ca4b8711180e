// Package localserver starts private Postgres (primaries and streaming standbys), PgBouncer
// and Redis servers from the installed binaries, in a temporary directory on a free loopback
// port, and can kill, stop, pause and restart them. The tests' fault injection and `idemq demo`
// use it.
package localserver

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// process is a private server: one command line, restartable, signalled as a process
// group so that a kill takes its children too (as a machine crash would).
type process struct {
	name string
	argv []string
	dir  string
	log  string
	cred *syscall.Credential // nil: run as ourselves

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

func (p *process) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		return fmt.Errorf("%s is already running", p.name)
	}
	logf, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o666)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.argv[0], p.argv[1:]...)
	cmd.Dir = p.dir
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: p.cred, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	done := make(chan struct{})
	go func() {
		cmd.Wait()
		logf.Close()
		close(done)
	}()
	p.cmd, p.done = cmd, done
	return nil
}

// signal sends sig to the server's process group.
func (p *process) signal(sig syscall.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return fmt.Errorf("%s is not running", p.name)
	}
	return syscall.Kill(-p.cmd.Process.Pid, sig)
}

// stop sends sig to the server (the leader only, or the group) and waits up to d for it to
// exit, then kills the group.
func (p *process) stop(sig syscall.Signal, group bool, d time.Duration) error {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return nil
	}
	pid := cmd.Process.Pid
	if group {
		pid = -pid
	}
	syscall.Kill(-cmd.Process.Pid, syscall.SIGCONT) // a paused server cannot exit
	syscall.Kill(pid, sig)
	var err error
	select {
	case <-done:
	case <-time.After(d):
		err = fmt.Errorf("%s did not exit within %s of %s; killed", p.name, d, sig)
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
	}
	// Reap what is left of the group (a killed postmaster's backends exit on their own,
	// but not at once: one in the middle of a disk write on a loaded machine takes a while).
	waitFor(15*time.Second, func() error {
		if syscall.Kill(-cmd.Process.Pid, 0) == nil {
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			return fmt.Errorf("group alive")
		}
		return nil
	})
	p.mu.Lock()
	p.cmd, p.done = nil, nil
	p.mu.Unlock()
	return err
}

func (p *process) logTail() string {
	b, _ := os.ReadFile(p.log)
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// serviceUser returns the credential to run a server as: ourselves, or the postgres user
// when we are root (initdb and postgres refuse to run as root).
func serviceUser(name string) (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup(name)
	if err != nil {
		return nil, fmt.Errorf("running as root, and there is no %q user to run the server as: %w", name, err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// ownedTempDir makes a temporary directory the server user can enter and write (a test's
// TempDir is 0700 and owned by root).
func ownedTempDir(prefix string, cred *syscall.Credential) (string, error) {
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		return "", err
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			os.RemoveAll(dir)
			return "", err
		}
	}
	return dir, nil
}

// waitFor calls ok every 20 ms until it returns nil or d has passed; it returns the last error.
func waitFor(d time.Duration, ok func() error) error {
	deadline := time.Now().Add(d)
	for {
		err := ok()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// FreePort returns a loopback TCP port that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
