package localserver_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/localserver"
	"github.com/idemq/idemq/internal/testenv"
)

// sharedPostgres is the machine's Postgres, which the tests only read from.
var sharedPostgres = testenv.ServerURL()

// TestPgBouncerTransactionPool: through a transaction-mode pool of 2 in front of the
// shared Postgres, four clients' transactions run on at most two server backends; while
// two clients hold a transaction open, a third waits, as SHOW POOLS tells.
func TestPgBouncerTransactionPool(t *testing.T) {
	testenv.NeedBinary(t, "pgbouncer", "apt-get install -y pgbouncer")
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := localserver.StartPgBouncer(sharedPostgres, "transaction", 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })

	clients := make([]*pgx.Conn, 4)
	for i := range clients {
		if clients[i], err = pgx.Connect(ctx, b.URL+"&default_query_exec_mode=simple_protocol"); err != nil {
			t.Fatal(err)
		}
		defer clients[i].Close(ctx)
	}
	pids := map[int32]bool{}
	for range 3 {
		for _, c := range clients {
			var pid int32
			if err := c.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
				t.Fatal(err)
			}
			pids[pid] = true
		}
	}
	if len(pids) > 2 {
		t.Fatalf("4 clients ran on %d server backends, want at most 2", len(pids))
	}

	// Two open transactions take both server connections; a third client's query waits.
	for _, c := range clients[:2] {
		if _, err := c.Exec(ctx, "BEGIN; SELECT 1"); err != nil {
			t.Fatal(err)
		}
	}
	waiting := make(chan error, 1)
	go func() {
		_, err := clients[2].Exec(ctx, "SELECT 1")
		waiting <- err
	}()
	var st localserver.PoolStats
	for st.ClientWaiting != 1 || st.ServerActive != 2 {
		if st, err = b.Pool(ctx, "postgres"); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-waiting:
			t.Fatalf("a third transaction ran while two held the pool of 2 (err %v); pool %+v", err, st)
		case <-ctx.Done():
			t.Fatalf("pool %+v, want 1 client waiting and 2 server connections active", st)
		case <-time.After(20 * time.Millisecond):
		}
	}
	for _, c := range clients[:2] {
		if _, err := c.Exec(ctx, "COMMIT"); err != nil {
			t.Fatal(err)
		}
	}
	if err := <-waiting; err != nil {
		t.Fatalf("the waiting client, once a connection was free: %v", err)
	}
}
