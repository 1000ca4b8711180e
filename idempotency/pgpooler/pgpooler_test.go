package pgpooler_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency/pgpooler"
	"github.com/idemq/idemq/internal/localserver"
	"github.com/idemq/idemq/internal/testenv"
)

// TestDetect tells Postgres itself, PgBouncer in session mode and PgBouncer in
// transaction mode apart, also when the transaction pool has a single server connection
// and when it has many.
func TestDetect(t *testing.T) {
	testenv.NeedBinary(t, "pgbouncer", "apt-get install -y pgbouncer")
	t.Parallel()
	server := testenv.ServerURL()
	for _, tc := range []struct {
		name  string
		url   func(t *testing.T) string
		want  pgpooler.Kind
		tries int
	}{
		{"postgres", func(*testing.T) string { return server }, pgpooler.Direct, 1},
		{"session pool", bouncer(server, "session", 4), pgpooler.SessionPooler, 3},
		{"transaction pool of 1", bouncer(server, "transaction", 1), pgpooler.TransactionPooler, 3},
		{"transaction pool of 8", bouncer(server, "transaction", 8), pgpooler.TransactionPooler, 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg, err := pgx.ParseConfig(tc.url(t))
			if err != nil {
				t.Fatal(err)
			}
			ctx := testenv.Context(t, time.Minute)
			for range tc.tries {
				got, err := pgpooler.Detect(ctx, cfg)
				if err != nil {
					t.Fatal(err)
				}
				if got != tc.want {
					t.Fatalf("Detect = %s, want %s", got, tc.want)
				}
			}
		})
	}
}

// bouncer starts a PgBouncer in front of server and returns its URL.
func bouncer(server, mode string, size int) func(t *testing.T) string {
	return func(t *testing.T) string {
		b, err := localserver.StartPgBouncer(server, mode, size)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Close() })
		return b.URL
	}
}

// TestIsPreparedStatementError has the server refuse a statement prepared twice and one
// that does not exist, as behind a transaction-mode pooler, and checks that both are told
// apart from another error.
func TestIsPreparedStatementError(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 10*time.Second)
	conn, err := pgx.Connect(ctx, testenv.ServerURL())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	_, twice := conn.Exec(ctx, `PREPARE idemq_twice AS SELECT 1; PREPARE idemq_twice AS SELECT 1`)
	_, missing := conn.Exec(ctx, `DEALLOCATE idemq_missing`)
	_, other := conn.Exec(ctx, `SELECT 1/0`)
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"prepared twice", twice, true},
		{"not prepared", missing, true},
		{"division by zero", other, false},
		{"nil", nil, false},
	} {
		if got := pgpooler.IsPreparedStatementError(tc.err); got != tc.want {
			t.Errorf("%s: IsPreparedStatementError(%v) = %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
}
