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
