package server_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/idempotency/server"
	"github.com/idemq/idemq/internal/testenv"
)

const typeSQLTransfer = "test:sql-transfer"

// HandleSQLTx runs each job once through database/sql, with the outbox's and a plain
// producer's duplicates, whether the Server opens its own *sql.DB or is given one; the
// ledger row and the handler's row commit together.
func TestRunRunsEachSQLJobOnce(t *testing.T) {
	t.Parallel()
	for _, given := range []bool{false, true} {
		t.Run(fmt.Sprintf("given=%t", given), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ctx := testenv.Context(t, 2*time.Minute)
			cfg := server.Config{Postgres: e.pool, Redis: e.rdb, Concurrency: 8, ShutdownTimeout: 5 * time.Second}
			if given {
				cfg.SQL = stdlib.OpenDBFromPool(e.pool)
				defer cfg.SQL.Close()
			}
			s, err := server.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			server.HandleSQLTx(s, typeSQLTransfer, func(ctx context.Context, tx *sql.Tx, j transfer) (json.RawMessage, error) {
				if _, err := tx.ExecContext(ctx, `INSERT INTO transfers (account, cents, ref) VALUES ($1, $2, $3)`, j.Account, j.Cents, j.Ref); err != nil {
					return nil, err
				}
				var n int
				err := tx.QueryRowContext(ctx, `SELECT count(*) FROM transfers WHERE account = $1`, j.Account).Scan(&n)
				return json.RawMessage(fmt.Sprintf(`{"entries":%d}`, n)), err
			})
			stop := run(t, s)
			client := asynq.NewClientFromRedisClient(e.rdb)
			defer client.Close()
			var jobs []outbox.Spec
			for i := range 12 {
				jobs = append(jobs, spec(t, typeSQLTransfer, transfer{Account: fmt.Sprintf("a-%d", i%3), Cents: 100, Ref: fmt.Sprintf("r-%d", i)}))
			}
			for _, j := range jobs {
				if _, err := s.Outbox().Enqueue(ctx, j); err != nil {
					t.Fatal(err)
				}
				for i := range 2 {
					if _, err := client.EnqueueContext(ctx, j.Task(fmt.Sprintf("%s-dup-%d", j.Key, i), time.Now())); err != nil {
						t.Fatal(err)
					}
				}
			}
			for _, j := range jobs {
				waitCompleted(t, s, j.Key, 30*time.Second)
			}
			waitIdle(t, e.rdb, 30*time.Second)
			for i := range jobs {
				if n := testenv.Count(t, e.pool, `SELECT count(*) FROM transfers WHERE ref = $1`, fmt.Sprintf("r-%d", i)); n != 1 {
					t.Errorf("transfer r-%d written %d times, want once", i, n)
				}
			}
			r, err := s.Ledger().Get(ctx, jobs[0].Key)
			if err != nil || r.Attempts != 1 || !strings.Contains(string(r.Result), `"entries"`) {
				t.Errorf("row %+v, %v: want completed at attempt 1 with the handler's result", r, err)
			}
			if err := stop(); err != nil {
				t.Fatalf("Run = %v after its context ended, want nil", err)
			}
		})
	}
}

// Run refuses to start SQL handlers on a driver it does not support, naming it.
func TestRunRefusesAnUnsupportedSQLDriver(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	other := testenv.OtherSQLDB(t)
	s, err := server.New(server.Config{Postgres: e.pool, Redis: e.rdb, SQL: other})
	if err != nil {
		t.Fatal(err)
	}
	server.HandleSQLTx(s, typeSQLTransfer, func(context.Context, *sql.Tx, transfer) (json.RawMessage, error) {
		t.Error("handler ran")
		return nil, nil
	})
	err = s.Run(testenv.Context(t, time.Minute))
	if err == nil || !strings.Contains(err.Error(), "testenv.OtherDriver") || !strings.Contains(err.Error(), "lib/pq") {
		t.Fatalf("Run = %v, want a refusal naming the driver and the supported ones", err)
	}
}
