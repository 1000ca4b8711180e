package localserver_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/localserver"
	"github.com/idemq/idemq/internal/testenv"
)

// TestStandbyFailover: a row committed on the primary is on the standby; after the primary
// is killed and the standby promoted, a multi-host URL naming both connects to the standby
// and writes there. Once with a synchronous standby, once with an asynchronous one.
func TestStandbyFailover(t *testing.T) {
	testenv.NeedBinary(t, "pg_basebackup", "apt-get install -y postgresql")
	for _, synchronous := range []bool{true, false} {
		name := "async"
		if synchronous {
			name = "sync"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			primary, err := localserver.StartPostgres()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { primary.Close() })
			start := time.Now()
			standby, err := localserver.StartStandby(primary, synchronous)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { standby.Close() })
			t.Logf("standby streaming after %s", time.Since(start).Round(time.Millisecond))

			execSQL(t, ctx, primary.URL, "CREATE TABLE t (v text)")
			execSQL(t, ctx, primary.URL, "INSERT INTO t VALUES ('seen')")
			waitRows(t, ctx, standby.URL, 1)
			want := 1
			if synchronous {
				// Committed, so flushed on the standby: it survives the primary's death
				// even though nobody waited for the standby to replay it.
				execSQL(t, ctx, primary.URL, "INSERT INTO t VALUES ('committed')")
				want = 2
			}

			if err := primary.Kill(); err != nil {
				t.Fatal(err)
			}
			start = time.Now()
			if err := standby.Promote(); err != nil {
				t.Fatalf("%v\n%s", err, standby.Log())
			}
			t.Logf("promoted in %s", time.Since(start).Round(time.Millisecond))

			url := localserver.MultiHostURL(primary, standby)
			execSQL(t, ctx, url, "INSERT INTO t VALUES ('after')")
			if got := count(t, ctx, standby.URL); got != want+1 {
				t.Fatalf("promoted standby has %d rows, want %d", got, want+1)
			}
		})
	}
}

// TestRebuildAsStandby: after a failover the old primary comes back, at its own port, as a
// synchronous standby of the promoted one; a write through the multi-host URL lands on the
// new primary and on the rebuilt standby; after a failover back, a multi-host write lands
// on the old primary, now primary again.
func TestRebuildAsStandby(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	a, b := testenv.StartPair(t, true)
	url := localserver.MultiHostURL(a, b)
	execSQL(t, ctx, url, "CREATE TABLE t (v text)")
	execSQL(t, ctx, url, "INSERT INTO t VALUES ('on a')")

	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := b.Promote(); err != nil {
		t.Fatalf("%v\n%s", err, b.Log())
	}
	port := a.Port()
	start := time.Now()
	if err := a.RebuildAsStandby(b, true); err != nil {
		t.Fatal(err)
	}
	t.Logf("old primary a sync standby again after %s", time.Since(start).Round(time.Millisecond))
	if a.Port() != port {
		t.Fatalf("rebuilt on port %d, want %d", a.Port(), port)
	}
	// Synchronous: the commit returns once a has flushed it, and a hot standby shows it
	// once replayed.
	execSQL(t, ctx, url, "INSERT INTO t VALUES ('on b')")
	waitRows(t, ctx, a.URL, 2)

	if err := b.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := a.Promote(); err != nil {
		t.Fatalf("%v\n%s", err, a.Log())
	}
	execSQL(t, ctx, url, "INSERT INTO t VALUES ('on a again')")
	if got := count(t, ctx, a.URL); got != 3 {
		t.Fatalf("a has %d rows, want 3", got)
	}
}

// TestMultiHostURLPicksThePrimary: with both servers up, the standby named first, a
// multi-host URL connects to the primary.
func TestMultiHostURLPicksThePrimary(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	primary, standby := testenv.StartPair(t, false)

	conn, err := pgx.Connect(ctx, localserver.MultiHostURL(standby, primary))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var recovering bool
	var port int
	if err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery(), current_setting('port')::int").Scan(&recovering, &port); err != nil {
		t.Fatal(err)
	}
	if recovering || port != primary.Port() {
		t.Fatalf("connected to port %d (in recovery: %v), want the primary's %d", port, recovering, primary.Port())
	}
}

func execSQL(t *testing.T, ctx context.Context, url, sql string) {
	t.Helper()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func count(t *testing.T, ctx context.Context, url string) int {
	t.Helper()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM t").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func waitRows(t *testing.T, ctx context.Context, url string, want int) {
	t.Helper()
	for {
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		var n int
		err = conn.QueryRow(ctx, "SELECT count(*) FROM t").Scan(&n)
		conn.Close(ctx)
		if err == nil && n >= want {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("standby has %d rows (%v), want %d", n, err, want)
		case <-time.After(20 * time.Millisecond):
		}
	}
}
