package dial_test

import (
	"context"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/dial"
)

func TestParseErrorsHideThePassword(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, u := range []string{"redis://:S3cretPW@[::1", "redis://u:S3cretPW@host:notaport/0"} {
		_, err := dial.Redis(ctx, u)
		if err == nil || !strings.HasPrefix(err.Error(), "REDIS_URL: ") || strings.Contains(err.Error(), "S3cretPW") {
			t.Errorf("dial.Redis(%q) = %v, want an error naming REDIS_URL without the password", u, err)
		}
	}
	for _, u := range []string{"postgres://u:S3cretPW@[::1/db", "postgres://u:S3cretPW@h/db?pool_max_conns=x"} {
		_, err := dial.Postgres(ctx, u, 0)
		if err == nil || !strings.HasPrefix(err.Error(), "DATABASE_URL: ") || strings.Contains(err.Error(), "S3cretPW") {
			t.Errorf("dial.Postgres(%q) = %v, want an error naming DATABASE_URL without the password", u, err)
		}
	}
}
