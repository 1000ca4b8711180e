package idempotencytest_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/handlers"
	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/idempotency/idempotencytest"
	"github.com/idemq/idemq/idempotency/server"
	"github.com/idemq/idemq/internal/fakepay"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// debitCase is a wallet:debit whose effect is its wallet entry.
func debitCase(pool *pgxpool.Pool) idempotencytest.Case {
	return idempotencytest.Case{
		Name: "debit",
		Task: func(id string) (*asynq.Task, error) {
			return tasks.NewDebitTask(tasks.Debit{AccountID: "acct-" + id, AmountCents: 250, Reference: "ref-" + id})
		},
		Effects: func(ctx context.Context, id string) (int, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM wallet_entries WHERE reference = $1`, "ref-"+id).Scan(&n)
			return n, err
		},
	}
}

// chargeCase is a payment:charge whose effect is the provider's charge of the order.
func chargeCase(pool *pgxpool.Pool) idempotencytest.Case {
	return idempotencytest.Case{
		Name: "charge",
		Task: func(id string) (*asynq.Task, error) {
			return tasks.NewChargeTask(tasks.Charge{OrderID: "order-" + id, CustomerID: "cust-" + id, AmountCents: 1999, Currency: "EUR"})
		},
		Effects: func(ctx context.Context, id string) (int, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM fakepay_charges WHERE order_id = $1`, "order-"+id).Scan(&n)
			return n, err
		},
	}
}

func provider(t *testing.T, pool *pgxpool.Pool, honorKeys bool) *handlers.Charger {
	srv := httptest.NewServer(fakepay.New(pool, fakepay.Config{HonorKeys: honorKeys}))
	t.Cleanup(srv.Close)
	// The harness ledgers have the default margin, a tenth of their 1 s lease.
	return handlers.NewCharger(srv.URL, nil).WithFenceMargin(100 * time.Millisecond)
}

// Our handlers, registered as idemq worker registers them, pass every schedule.
func TestOurHandlersTakeEffectOnce(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	charger := provider(t, pool, true)
	cfg := idempotencytest.Config{Pool: pool, Redis: rdb, Register: func(w *asynqmw.Worker, mux *asynq.ServeMux) {
		mux.Handle(tasks.TypeDebit, asynqmw.Transactional(w, tasks.TypeDebit, tasks.DecodeDebit, handlers.Debit))
		mux.Handle(tasks.TypeCharge, asynqmw.Leased(w, tasks.TypeCharge, tasks.DecodeCharge, func(ctx context.Context, c tasks.Charge) (json.RawMessage, error) {
			return charger.Charge(ctx, c.Key(), c)
		}))
	}}
	idempotencytest.Run(t, cfg, debitCase(pool), chargeCase(pool))
}

// recorder is a testing.TB that records what the harness reports instead of failing.
type recorder struct {
	testing.TB
	mu   sync.Mutex
	errs []string
}

func (r *recorder) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

func (r *recorder) report() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.errs, "\n")
}

// mustCatch runs c under schedule s with a recording TB and fails unless the harness
// reported a broken exactly-once whose message holds every one of want.
func mustCatch(t *testing.T, cfg idempotencytest.Config, c idempotencytest.Case, s idempotencytest.Schedule, want ...string) {
	t.Helper()
	rec := &recorder{TB: t}
	idempotencytest.Check(rec, cfg, c, s)
	got := rec.report()
	if got == "" {
		t.Fatalf("%s under %s: the harness reported nothing", c.Name, s)
	}
	for _, w := range want {
		if !strings.Contains(got, w) {
			t.Errorf("%s under %s: the report does not say %q:\n%s", c.Name, s, w, got)
		}
	}
	t.Logf("%s under %s, as reported:\n%s", c.Name, s, got)
}

// A debit that writes through the pool instead of the transaction it was given.
func TestCatchesADebitThatWritesThroughThePool(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	cfg := idempotencytest.Config{Pool: pool, Redis: rdb, Register: func(w *asynqmw.Worker, mux *asynq.ServeMux) {
		mux.Handle(tasks.TypeDebit, asynqmw.Transactional(w, tasks.TypeDebit, tasks.DecodeDebit, func(ctx context.Context, _ pgx.Tx, d tasks.Debit) (json.RawMessage, error) {
			_, fence, _ := idempotency.FromContext(ctx)
			_, err := pool.Exec(ctx, `INSERT INTO wallet_entries (account_id, amount_cents, reference, fence) VALUES ($1, $2, $3, $4)`,
				d.AccountID, d.AmountCents, d.Reference, fence)
			return json.RawMessage(`{}`), err
		}))
	}}
	mustCatch(t, cfg, debitCase(pool), idempotencytest.CrashAfterEffect, "writes outside the transaction", "happened 2 times")
	mustCatch(t, cfg, debitCase(pool), idempotencytest.ErrorAfterEffect, "writes outside the transaction")
}

// A charge that sends a fresh random Idempotency-Key instead of the job's key.
func TestCatchesAChargeWithARandomKey(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	charger := provider(t, pool, true)
	cfg := idempotencytest.Config{Pool: pool, Redis: rdb, Register: func(w *asynqmw.Worker, mux *asynq.ServeMux) {
		mux.Handle(tasks.TypeCharge, asynqmw.Leased(w, tasks.TypeCharge, tasks.DecodeCharge, func(ctx context.Context, c tasks.Charge) (json.RawMessage, error) {
			var b [8]byte
			rand.Read(b[:])
			return charger.Charge(ctx, "random-"+hex.EncodeToString(b[:]), c)
		}))
	}}
	mustCatch(t, cfg, chargeCase(pool), idempotencytest.CrashAfterEffect, "happened 2 times", "honouring the job's key")
	mustCatch(t, cfg, chargeCase(pool), idempotencytest.ErrorAfterEffect, "happened 2 times")
}

// A charge against a provider that does not honour idempotency keys: the honest limit
// of leased work, which crash-after-effect must show.
func TestCatchesAProviderThatIgnoresKeys(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	charger := provider(t, pool, false)
	cfg := idempotencytest.Config{Pool: pool, Redis: rdb, Register: func(w *asynqmw.Worker, mux *asynq.ServeMux) {
		mux.Handle(tasks.TypeCharge, asynqmw.Leased(w, tasks.TypeCharge, tasks.DecodeCharge, func(ctx context.Context, c tasks.Charge) (json.RawMessage, error) {
			return charger.Charge(ctx, c.Key(), c)
		}))
	}}
	mustCatch(t, cfg, chargeCase(pool), idempotencytest.CrashAfterEffect, "happened 2 times", "a provider that honours it")
}

// A transactional handler that calls the provider inside its transaction: external I/O
// that no rollback undoes, even when the provider honours the key.
func TestCatchesExternalIOInATransactionalHandler(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	charger := provider(t, pool, true)
	cfg := idempotencytest.Config{Pool: pool, Redis: rdb, Register: func(w *asynqmw.Worker, mux *asynq.ServeMux) {
		mux.Handle(tasks.TypeCharge, asynqmw.Transactional(w, tasks.TypeCharge, tasks.DecodeCharge, func(ctx context.Context, _ pgx.Tx, c tasks.Charge) (json.RawMessage, error) {
			return charger.Charge(ctx, c.Key(), c)
		}))
	}}
	mustCatch(t, cfg, chargeCase(pool), idempotencytest.CrashAfterEffect, "visible before its transaction committed")
}

// The example's application handler, against a refunds table of its own, passes.
func TestExampleRefund(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	testenv.Exec(t, pool, `CREATE TABLE refunds (order_id text NOT NULL, cents bigint NOT NULL)`)
	cfg, refunds := refundHarness(pool, rdb)
	idempotencytest.Run(t, cfg, refunds)
}

// A checkout's charge (a Step, at a provider that honours its key) and its order row (a
// StepTx) take effect once under every schedule. Its receipt goes to a provider that
// honours no key, so a crash between that effect and its record sends it again: it is not
// counted here (TestCheckoutResumesAfterItsLastRecordedStep in cmd/idemq shows it).
func TestCheckoutStepsTakeEffectOnce(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	charger := provider(t, pool, true)
	cfg := idempotencytest.Config{Pool: pool, Redis: rdb, Handlers: func(r server.Registrar) {
		server.HandleLeased(r, tasks.TypeCheckout, charger.Checkout, server.WithDecoder(tasks.DecodeCheckout))
	}}
	idempotencytest.Run(t, cfg, checkoutCase(pool, "checkout-charge", countCharges), checkoutCase(pool, "checkout-order", countOrders))
}

// Counters of a checkout's effects, by order.
const (
	countCharges = `SELECT count(*) FROM fakepay_charges WHERE order_id = $1`
	countOrders  = `SELECT count(*) FROM orders WHERE order_id = $1`
	countEmails  = `SELECT count(*) FROM fakepay_emails WHERE order_id = $1`
)

// checkoutCase is an order:checkout whose effect is counted by count, a query on the order.
func checkoutCase(pool *pgxpool.Pool, name, count string) idempotencytest.Case {
	return idempotencytest.Case{
		Name: name,
		Task: func(id string) (*asynq.Task, error) {
			return tasks.NewCheckoutTask(tasks.Checkout{OrderID: "order-" + id, CustomerID: "cust-" + id, AmountCents: 1999, Currency: "EUR", Email: "a@example.com"})
		},
		Effects: func(ctx context.Context, id string) (int, error) {
			var n int
			err := pool.QueryRow(ctx, count, "order-"+id).Scan(&n)
			return n, err
		},
	}
}

// chargeStep is a checkout's first step, as the checkout handler takes it: the charge,
// recorded as step "charge".
func chargeStep(ctx context.Context, charger *handlers.Charger, c tasks.Checkout) (handlers.ChargeResult, error) {
	return idempotency.Step(ctx, "charge", func(ctx context.Context, key string) (handlers.ChargeResult, error) {
		return charger.ChargeCheckout(ctx, key, c)
	})
}

// checkoutConfig registers fn as the order:checkout handler.
func checkoutConfig(pool *pgxpool.Pool, rdb *redis.Client, fn func(context.Context, tasks.Checkout) (json.RawMessage, error)) idempotencytest.Config {
	return idempotencytest.Config{Pool: pool, Redis: rdb, Handlers: func(r server.Registrar) {
		server.HandleLeased(r, tasks.TypeCheckout, fn, server.WithDecoder(tasks.DecodeCheckout))
	}}
}

// The harness finds a checkout's steps by running it, and refuses a step schedule for a
// step the handler never calls.
func TestStepsAreFound(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	charger := provider(t, pool, true)
	ctx := testenv.Context(t, time.Minute)
	cfg := checkoutConfig(pool, rdb, charger.Checkout)
	rep, err := idempotencytest.Verify(ctx, cfg, checkoutCase(pool, "checkout-charge", countCharges), idempotencytest.SequentialDuplicate)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := fmt.Sprint(rep.Steps), "[charge record receipt]"; got != want || rep.Failed() {
		t.Fatalf("checkout's steps: got %s (problems %q), want %s", got, rep.Problems, want)
	}
	mustCatch(t, cfg, checkoutCase(pool, "checkout-charge", countCharges), idempotencytest.CrashAfterStep("refund"),
		`crash after step "refund" effect, before its record`, `without a step "refund"`, `["charge" "record" "receipt"]`)
}

// A checkout's receipt goes to a provider that honours no key: a crash between its effect
// and its record sends it twice, and the harness names the step.
func TestCatchesAStepWhoseProviderIgnoresKeys(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	charger := provider(t, pool, true)
	mustCatch(t, checkoutConfig(pool, rdb, charger.Checkout), checkoutCase(pool, "checkout-email", countEmails), idempotencytest.CrashAfterStep("receipt"),
		`crash after step "receipt" effect, before its record: effect "checkout-email" happened 2 times`, `the effect is Step "receipt"'s`, "honouring the step key")
}

// A checkout that emails its receipt outside any step, between its charge and its order.
func TestCatchesAnEffectOutsideAnyStep(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	charger := provider(t, pool, true)
	cfg := checkoutConfig(pool, rdb, func(ctx context.Context, c tasks.Checkout) (json.RawMessage, error) {
		charge, err := chargeStep(ctx, charger, c)
		if err != nil {
			return nil, err
		}
		key, _, _ := idempotency.FromContext(ctx)
		if _, err := charger.SendReceipt(ctx, key, c); err != nil {
			return nil, err
		}
		row, err := idempotency.StepTx(ctx, "record", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			return handlers.RecordOrder(ctx, tx, c, charge.ChargeID)
		})
		return json.RawMessage(fmt.Sprintf(`{"order_row":%d}`, row)), err
	})
	mustCatch(t, cfg, checkoutCase(pool, "checkout-email", countEmails), idempotencytest.CrashAfterStep("record"),
		`crash after step "record" effect, before its record: effect "checkout-email" happened 2 times`, `outside any step, after step "charge"`)
}

// A checkout that writes its order row in a Step (through the pool) instead of a StepTx:
// a crash between the row and the step's record writes it again.
func TestCatchesADatabaseEffectInStep(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	charger := provider(t, pool, true)
	cfg := checkoutConfig(pool, rdb, func(ctx context.Context, c tasks.Checkout) (json.RawMessage, error) {
		charge, err := chargeStep(ctx, charger, c)
		if err != nil {
			return nil, err
		}
		row, err := idempotency.Step(ctx, "record", func(ctx context.Context, _ string) (int64, error) {
			var row int64
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
				row, err = handlers.RecordOrder(ctx, tx, c, charge.ChargeID)
				return err
			})
			return row, err
		})
		return json.RawMessage(fmt.Sprintf(`{"order_row":%d}`, row)), err
	})
	mustCatch(t, cfg, checkoutCase(pool, "checkout-order", countOrders), idempotencytest.CrashAfterStep("record"),
		`crash after step "record" effect, before its record: effect "checkout-order" happened 2 times`, `the effect is Step "record"'s`, "belongs in StepTx")
}

// A checkout whose order row is a Step's database effect, run on a context that outlives
// the lease (context.WithoutCancel): a stale owner that wakes after a takeover writes the
// row again before its record is refused.
func TestCatchesAStaleOwnerThatOutlivesItsLease(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	charger := provider(t, pool, true)
	cfg := checkoutConfig(pool, rdb, func(ctx context.Context, c tasks.Checkout) (json.RawMessage, error) {
		charge, err := chargeStep(ctx, charger, c)
		if err != nil {
			return nil, err
		}
		row, err := idempotency.Step(context.WithoutCancel(ctx), "record", func(ctx context.Context, _ string) (int64, error) {
			var row int64
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
				row, err = handlers.RecordOrder(ctx, tx, c, charge.ChargeID)
				return err
			})
			return row, err
		})
		return json.RawMessage(fmt.Sprintf(`{"order_row":%d}`, row)), err
	})
	mustCatch(t, cfg, checkoutCase(pool, "checkout-order", countOrders), idempotencytest.StaleOwnerAfterStep("charge"),
		`stale owner after step "charge": effect "checkout-order" happened 2 times`, `ran step "record"'s effect after its lease was taken over`)
}

// A checkout that charges the provider inside a StepTx: external I/O that no rollback
// undoes. The provider honours the step key, so the count stays 1, and the harness still
// names the step.
func TestCatchesExternalIOInAStepTx(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	charger := provider(t, pool, true)
	cfg := checkoutConfig(pool, rdb, func(ctx context.Context, c tasks.Checkout) (json.RawMessage, error) {
		key, _, _ := idempotency.FromContext(ctx)
		stepKey, err := idempotency.StepKey(key, "charge")
		if err != nil {
			return nil, err
		}
		charge, err := idempotency.StepTx(ctx, "charge", func(ctx context.Context, _ pgx.Tx) (handlers.ChargeResult, error) {
			return charger.ChargeCheckout(ctx, stepKey, c)
		})
		return json.RawMessage(fmt.Sprintf(`{"charge_id":%q}`, charge.ChargeID)), err
	})
	mustCatch(t, cfg, checkoutCase(pool, "checkout-charge", countCharges), idempotencytest.CrashAfterStep("charge"),
		`crash after step "charge" effect, before its record: the effect of StepTx "charge" was visible before its transaction committed`)
}

// The debit written through database/sql (server.HandleSQLTx, over pgx's stdlib) passes
// every schedule, as the pgx one does; one that writes through the *sql.DB instead of
// the transaction it was given is caught.
func TestSQLHandlersTakeEffectOnce(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	cfg := idempotencytest.Config{Pool: pool, Redis: rdb, Handlers: func(r server.Registrar) {
		server.HandleSQLTx(r, tasks.TypeDebit, handlers.DebitSQL, server.WithDecoder(tasks.DecodeDebit))
	}}
	idempotencytest.Run(t, cfg, debitCase(pool))

	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { db.Close() })
	leaky := idempotencytest.Config{Pool: pool, Redis: rdb, Handlers: func(r server.Registrar) {
		server.HandleSQLTx(r, tasks.TypeDebit, func(ctx context.Context, _ *sql.Tx, d tasks.Debit) (json.RawMessage, error) {
			_, fence, _ := idempotency.FromContext(ctx)
			_, err := db.ExecContext(ctx, `INSERT INTO wallet_entries (account_id, amount_cents, reference, fence) VALUES ($1, $2, $3, $4)`,
				d.AccountID, d.AmountCents, d.Reference, fence)
			return json.RawMessage(`{}`), err
		}, server.WithDecoder(tasks.DecodeDebit))
	}}
	mustCatch(t, leaky, debitCase(pool), idempotencytest.CrashAfterEffect, "writes outside the transaction", "happened 2 times")
}

// A checkout whose order row is a StepSQLTx (database/sql over pgx's stdlib) passes every
// schedule, its step schedules included: the row and the step's record commit together.
func TestStepSQLTxTakesEffectOnce(t *testing.T) {
	t.Parallel()
	pool, rdb := testenv.Postgres(t), testenv.Redis(t)
	charger := provider(t, pool, true)
	cfg := checkoutConfig(pool, rdb, func(ctx context.Context, c tasks.Checkout) (json.RawMessage, error) {
		charge, err := chargeStep(ctx, charger, c)
		if err != nil {
			return nil, err
		}
		row, err := idempotency.StepSQLTx(ctx, "record", func(ctx context.Context, tx *sql.Tx) (int64, error) {
			_, fence, _ := idempotency.FromContext(ctx)
			var id int64
			err := tx.QueryRowContext(ctx, `INSERT INTO orders (order_id, customer_id, amount_cents, currency, charge_id, fence)
				VALUES ($1, $2, $3, $4, $5, $6) RETURNING id`, c.OrderID, c.CustomerID, c.AmountCents, c.Currency, charge.ChargeID, fence).Scan(&id)
			return id, err
		})
		return json.RawMessage(fmt.Sprintf(`{"order_row":%d}`, row)), err
	})
	idempotencytest.Run(t, cfg, checkoutCase(pool, "checkout-order", countOrders))
}
