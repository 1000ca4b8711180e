package idempotency_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// BenchmarkLedgerGrowth is a diagnostic (it times a run, so it is a benchmark, not a
// test: go test -run '^$' -bench LedgerGrowth -benchtime 1x ./idempotency/): it grows one
// connection's ledger from empty past 100,000 rows through DoTx and Do, so that every
// statement is prepared and planned while the tables are small, and prints the rate of
// each 10,000 rows and the last window's rate over the first's. A plan that joins by
// scanning the table would fall with its size (it once fell to a fifth by 50,000 rows);
// the run fails if the last window runs at under half the first's rate.
func BenchmarkLedgerGrowth(b *testing.B) {
	for _, mode := range []string{"DoTx", "Do"} {
		b.Run(mode, func(t *testing.B) {
			pool := testenv.Pool(t, testenv.PostgresURL(t)+"&pool_max_conns=1")
			l := idempotency.New(pool, &idempotency.Config{HeartbeatPool: pool})
			defer l.Close()
			ctx := testenv.Context(t, 20*time.Minute)
			if _, err := pool.Exec(ctx, `CREATE TABLE effects (key text NOT NULL)`); err != nil {
				t.Fatal(err)
			}
			const windows, per, callers = 11, 10_000, 32
			var rates []float64
			for w := range windows {
				start := time.Now()
				var wg sync.WaitGroup
				errs := make(chan error, callers)
				for c := range callers {
					wg.Go(func() {
						for i := c; i < per; i += callers {
							key := fmt.Sprintf("grow-%02d-%05d", w, i)
							var err error
							if mode == "DoTx" {
								_, err = l.DoTx(ctx, req(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
									_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key)
									return json.RawMessage(`1`), err
								})
							} else {
								_, err = l.Do(ctx, req(key), func(context.Context) (json.RawMessage, error) { return json.RawMessage(`1`), nil })
							}
							if err != nil {
								errs <- err
								return
							}
						}
					})
				}
				wg.Wait()
				close(errs)
				if err := <-errs; err != nil {
					t.Fatal(err)
				}
				rate := per / time.Since(start).Seconds()
				rates = append(rates, rate)
				t.Logf("%s: rows %6d..%6d: %6.0f/s", mode, w*per, (w+1)*per, rate)
			}
			last, first := rates[len(rates)-1], rates[0]
			t.ReportMetric(last/first, "last/first")
			if last < first/2 {
				t.Errorf("%s: the rate fell from %.0f/s to %.0f/s as the ledger grew past %d rows", mode, first, last, windows*per)
			}
		})
	}
}
