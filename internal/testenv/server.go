package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
)

// process is a private server: one command line, restartable, signalled as a process
// group so that a kill takes its children too (as a machine crash would).
type process struct {
	t    testing.TB
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
	// but not at once).
	waitFor(5*time.Second, func() error {
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
func serviceUser(t testing.TB, name string) *syscall.Credential {
	t.Helper()
	if os.Geteuid() != 0 {
		return nil
	}
	u, err := user.Lookup(name)
	if err != nil {
		fatalf(t, "running as root, and there is no %q user to run the server as: %v", name, err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
}

// ownedTempDir makes a temporary directory the server user can enter and write (t.TempDir
// is 0700 and owned by root), removed when the test ends.
func ownedTempDir(t testing.TB, prefix string, cred *syscall.Credential) string {
	t.Helper()
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		fatalf(t, "temp dir: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			fatalf(t, "chown %s: %v", dir, err)
		}
	}
	return dir
}
