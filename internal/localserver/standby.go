package localserver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// StartStandby copies primary with pg_basebackup into a temporary directory and starts the
// copy as a hot standby streaming from it, on a free loopback port, with the primary's
// settings and then settings over its own. It returns once the primary reports the standby
// streaming. With synchronous, it also names the standby in the primary's
// synchronous_standby_names (ALTER SYSTEM, reloaded) and returns once the primary reports it
// sync: from then on a commit on the primary returns only after the standby has flushed it
// (synchronous_commit stays on). Kill the primary and Promote the standby to fail over.
//
// The standby's application_name is "standby_<port>". It never inherits the primary's
// synchronous_standby_names, so that once promoted it does not wait for a standby it has
// not got.
func StartStandby(primary *Postgres, synchronous bool, settings ...string) (*Postgres, error) {
	root, err := ownedTempDir("idemq-pg-standby-", primary.p.cred)
	if err != nil {
		return nil, err
	}
	s, err := newPostgres(root, primary.p.cred, append(slices.Clone(primary.settings), settings...))
	if err != nil {
		os.RemoveAll(root)
		return nil, err
	}
	s.p.name = "private postgres standby"
	if err := s.follow(primary, synchronous); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// RebuildAsStandby makes s a new standby of primary on its own port, URL and settings, as
// StartStandby makes one (synchronous too): it kills s if it runs, removes its cluster,
// copies primary into its place with pg_basebackup, starts it and waits until the primary
// reports it streaming (and sync). It brings a primary that was failed over back as the
// standby of the server promoted in its place, so that a multi-host URL naming both stays
// valid. On error s is left stopped. Do not call it while another goroutine starts or
// stops s.
func (s *Postgres) RebuildAsStandby(primary *Postgres, synchronous bool) error {
	if err := s.Kill(); err != nil {
		return err
	}
	if err := os.RemoveAll(s.dataDir()); err != nil {
		return err
	}
	if err := s.follow(primary, synchronous); err != nil {
		s.Kill()
		return err
	}
	return nil
}

// follow copies primary into s's (absent) cluster directory with pg_basebackup, starts s
// as a standby streaming from it under application_name "standby_<port>", and waits until
// the primary reports it streaming; with synchronous, it first names it in the primary's
// synchronous_standby_names and waits until it is sync.
func (s *Postgres) follow(primary *Postgres, synchronous bool) error {
	basebackup, err := pgBinary("pg_basebackup")
	if err != nil {
		return err
	}
	name := fmt.Sprintf("standby_%d", s.port)
	// -R writes standby.signal and a primary_conninfo made of these connection options
	// (application_name included); -c fast checkpoints at once instead of spreading it.
	conninfo := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres application_name=%s", primary.port, name)
	cmd := exec.Command(basebackup, "-D", s.dataDir(), "-d", conninfo, "-R", "-X", "stream", "-c", "fast", "--no-sync")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.p.cred}
	cmd.Dir = s.dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("pg_basebackup: %w\n%s", err, out)
	}
	if err := dropSetting(filepath.Join(s.dataDir(), "postgresql.auto.conf"), "synchronous_standby_names"); err != nil {
		return err
	}
	if err := s.Start(); err != nil {
		return err
	}

	want := "async"
	if synchronous {
		want = "sync"
		err = withConn(primary.URL, 10*time.Second, func(ctx context.Context, conn *pgx.Conn) error {
			if _, err := conn.Exec(ctx, "ALTER SYSTEM SET synchronous_standby_names = '"+name+"'"); err != nil {
				return err
			}
			_, err := conn.Exec(ctx, "SELECT pg_reload_conf()")
			return err
		})
		if err != nil {
			return fmt.Errorf("make %s synchronous: %w", name, err)
		}
	}
	err = waitFor(30*time.Second, func() error { return replicating(primary.URL, name, want) })
	if err != nil {
		return fmt.Errorf("standby %s: %w\n%s", name, err, s.Log())
	}
	return nil
}

// Promote ends the standby's recovery (pg_promote, waiting up to 60 s) and returns once it
// accepts writes. It fails on a server that is not a standby.
func (s *Postgres) Promote() error {
	return withConn(s.URL, 70*time.Second, func(ctx context.Context, conn *pgx.Conn) error {
		var promoted bool
		if err := conn.QueryRow(ctx, "SELECT pg_promote(true, 60)").Scan(&promoted); err != nil {
			return fmt.Errorf("promote: %w", err)
		}
		if !promoted {
			return errors.New("promote: still in recovery after 60 s")
		}
		return nil
	})
}

// HoldWAL stops (SIGSTOP) the primary's WAL senders: from then on its standbys receive
// nothing, as an asynchronous standby that fell behind, and a synchronous standby makes
// the primary's commits wait. Kill the primary to end it.
func (s *Postgres) HoldWAL() error {
	return withConn(s.URL, 10*time.Second, func(ctx context.Context, conn *pgx.Conn) error {
		rows, err := conn.Query(ctx, "SELECT pid FROM pg_stat_replication")
		if err != nil {
			return err
		}
		pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			return errors.New("hold WAL: no standby is connected")
		}
		for _, pid := range pids {
			if err := syscall.Kill(int(pid), syscall.SIGSTOP); err != nil {
				return fmt.Errorf("hold WAL: stop WAL sender %d: %w", pid, err)
			}
		}
		return nil
	})
}

// WaitWritable tries, every 20 ms, to commit a write through a new connection to url (a
// multi-host URL finds whichever server accepts writes) and returns how long after since
// the first one committed; an error once d has passed since since, or ctx ended.
func WaitWritable(ctx context.Context, url string, since time.Time, d time.Duration) (time.Duration, error) {
	for {
		err := withConn(url, time.Second, func(cctx context.Context, conn *pgx.Conn) error {
			// A standby cannot assign a transaction id.
			_, err := conn.Exec(cctx, "SELECT pg_current_xact_id()")
			return err
		})
		if err == nil {
			return time.Since(since), nil
		}
		if time.Since(since) > d || ctx.Err() != nil {
			return 0, fmt.Errorf("no write committed within %s: %w", d, err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// MultiHostURL names the servers in one URL (postgres://postgres@h1:p1,h2:p2/postgres)
// with target_session_attrs=read-write: pgx tries them in order and connects to the first
// that accepts writes, the primary.
func MultiHostURL(servers ...*Postgres) string {
	hosts := make([]string, len(servers))
	for i, s := range servers {
		hosts[i] = fmt.Sprintf("127.0.0.1:%d", s.port)
	}
	return "postgres://postgres@" + strings.Join(hosts, ",") + "/postgres?sslmode=disable&target_session_attrs=read-write"
}

// replicating reports nil once the primary at url shows the standby name streaming with
// sync_state want ("async" or "sync").
func replicating(url, name, want string) error {
	return withConn(url, time.Second, func(ctx context.Context, conn *pgx.Conn) error {
		var state, sync string
		err := conn.QueryRow(ctx, "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = $1", name).Scan(&state, &sync)
		if errors.Is(err, pgx.ErrNoRows) {
			return errors.New("not connected to the primary yet")
		}
		if err != nil {
			return err
		}
		if state != "streaming" || sync != want {
			return fmt.Errorf("state %s, sync_state %s; want streaming, %s", state, sync, want)
		}
		return nil
	})
}

// withConn runs f on a connection to url, all within d.
func withConn(url string, d time.Duration, f func(context.Context, *pgx.Conn) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return f(ctx, conn)
}

// dropSetting removes the lines that set name from a postgresql.auto.conf.
func dropSetting(path, name string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var kept []string
	for _, line := range strings.SplitAfter(string(b), "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), name) {
			kept = append(kept, line)
		}
	}
	return os.WriteFile(path, []byte(strings.Join(kept, "")), 0o600)
}
