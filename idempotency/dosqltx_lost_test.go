package idempotency

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
)

// TestDoSQLTxLostCommitAnswer: a DoSQLTx COMMIT whose answer does not come within the
// write timeout (a deferred trigger makes it slow) is cut: pgx's stdlib drops the
// connection, which also asks the server to cancel it, and the delivery learns the outcome
// from the transaction id drawn with its claim. When the trigger gives in, nothing
// committed and the delivery gets an error; when it swallows the cancel, the row and the
// effect committed and the delivery succeeds.
func TestDoSQLTxLostCommitAnswer(t *testing.T) {
	t.Parallel()
	for _, commits := range []bool{false, true} {
		t.Run(fmt.Sprintf("commits=%t", commits), func(t *testing.T) {
			t.Parallel()
			ctx := testenv.Context(t, 2*time.Minute)
			pool := testenv.Postgres(t)
			var resolved atomic.Int64
			l := New(pool, &Config{WriteTimeout: lostCommitTimeout, ClaimLockTimeout: 100 * time.Millisecond,
				Observe: func(ev Event, _ string) {
					if ev == EventCommitResolved {
						resolved.Add(1)
					}
				}})
			defer l.Close()
			slowCommitOf(t, pool, "slow", commits)
			res, err := l.DoSQLTx(ctx, batchReq("slow"), func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error) {
				_, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ('slow')`)
				return json.RawMessage(`true`), err
			})
			switch {
			case commits && (err != nil || string(res.Result) != "true"):
				t.Errorf("DoSQLTx: %+v, %v; want success learned from the transaction id", res, err)
			case !commits && (err == nil || !strings.Contains(err.Error(), "aborted")):
				t.Errorf("DoSQLTx: %v, want an aborted commit", err)
			}
			if n := resolved.Load(); n != 1 {
				t.Errorf("%d commit_resolved events, want 1", n)
			}
			want := 0
			if commits {
				want = 1
			}
			if n := batchCount(t, pool, `SELECT count(*) FROM effects`); n != want {
				t.Errorf("effects = %d, want %d", n, want)
			}
			if n := batchCount(t, pool, `SELECT count(*) FROM processed_jobs WHERE status = 'completed'`); n != want {
				t.Errorf("completed rows = %d, want %d", n, want)
			}
		})
	}
}
