package dial_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/dial"
	"github.com/idemq/idemq/internal/testenv"
)

func TestParseErrorsHideThePassword(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct {
		url     string
		cluster bool
	}{
		{"redis://:S3cretPW@[::1", false},
		{"redis://u:S3cretPW@host:notaport/0", false},
		{"redis://u:S3cretPW@host:26379/0?master_name=m&bogus=1", false},
		{"redis://u:S3cretPW@[::1?addr=h2:7001", true},
	} {
		_, err := dial.Redis(ctx, tc.url, tc.cluster)
		if err == nil || !strings.HasPrefix(err.Error(), "REDIS_URL") || strings.Contains(err.Error(), "S3cretPW") {
			t.Errorf("dial.Redis(%q, cluster %v) = %v, want an error naming REDIS_URL without the password", tc.url, tc.cluster, err)
		}
		if _, err := dial.AsynqRedis(tc.url, tc.cluster); err == nil || strings.Contains(err.Error(), "S3cretPW") {
			t.Errorf("dial.AsynqRedis(%q, cluster %v) = %v, want an error without the password", tc.url, tc.cluster, err)
		}
	}
	for _, u := range []string{"postgres://u:S3cretPW@[::1/db", "postgres://u:S3cretPW@h/db?pool_max_conns=x"} {
		_, err := dial.Postgres(ctx, u, 0)
		if err == nil || !strings.HasPrefix(err.Error(), "DATABASE_URL: ") || strings.Contains(err.Error(), "S3cretPW") {
			t.Errorf("dial.Postgres(%q) = %v, want an error naming DATABASE_URL without the password", u, err)
		}
	}
}

// A pool_max_conns in the DSN wins over the size the caller computed; without it the
// caller's size holds.
func TestExplicitPoolSizeWins(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 30*time.Second)
	base := testenv.PostgresURL(t)
	for _, tc := range []struct {
		dsn  string
		want int32
	}{{base, 7}, {base + "&pool_max_conns=3", 3}} {
		pool, err := dial.Postgres(ctx, tc.dsn, 7)
		if err != nil {
			t.Fatal(err)
		}
		if got := pool.Config().MaxConns; got != tc.want {
			t.Errorf("pool size %d, want %d (DSN sets it: %t)", got, tc.want, tc.want == 3)
		}
		pool.Close()
	}
}
