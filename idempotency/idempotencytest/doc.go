// Package idempotencytest proves, from go test, that a user's own handlers take effect
// exactly once under what exactly-once exists for: duplicate deliveries, crashes before
// and after the effect, a stale worker that wakes after its lease, an error returned after
// the effect, Redis losing the task and the lock, and shared commits that partly fail.
//
// The harness runs each case through real asynq servers and the real middleware
// (asynqmw.Worker) against the caller's real Postgres and Redis, one named schedule at a
// time, and then checks the case's effect counter: exactly 1, and every delivery that
// succeeded answered the same result. A crash is a whole worker process dying as under
// kill -9: its delivery's goroutine never returns (no deferred function, no completion,
// no lock release), its Postgres sessions are terminated by the server without a
// ROLLBACK (pg_terminate_backend), its Redis connections and heartbeats stop, and asynq
// hands the task back; another worker process delivers it again. See Schedule for each
// schedule.
//
// A handler that records steps (idempotency.Step and StepTx) gets, from Run, three more
// schedules per step it calls, found from SequentialDuplicate, which Run runs first:
// CrashAfterStep (the process dies after the step's effect, before its record),
// StaleOwnerAfterStep (a takeover after the step was recorded; the old owner's next step
// must be refused) and DuplicateAfterStep (a second delivery while the job is between
// steps). A handler without steps gets none. A failure names the schedule, the step and
// where the effect happened: in which Step or StepTx, or outside any step. A Step's
// external effect runs again after a crash between its effect and its record, so the
// harness expects it keyed: the provider honours the step key, and the counter counts
// what the provider did, as for a leased job's key.
//
// Keys are not prefixed: the ledger key is the provider's idempotency key. Each schedule
// gives the case a fresh id to build the job (and so its key) from, and refuses a key
// that another running schedule uses.
//
// In the application's tests, with its handlers registered by the function its server
// registers them with (a func(server.Registrar)):
//
//	func register(r server.Registrar) { server.HandleTx(r, "billing:refund", refund) } // main calls register(srv)
//
//	func TestRefundsTakeEffectOnce(t *testing.T) {
//		pool, rdb := testPostgres(t), testRedis(t) // migrated with idemq's migrations and the app's
//		cfg := idempotencytest.Config{Pool: pool, Redis: rdb, Handlers: register}
//		idempotencytest.Run(t, cfg, idempotencytest.Case{
//			Name: "refund",
//			Task: func(id string) (*asynq.Task, error) { return newRefundTask("o-" + id) },
//			Effects: func(ctx context.Context, id string) (n int, err error) {
//				err = pool.QueryRow(ctx, `SELECT count(*) FROM refunds WHERE order_id = $1`, "o-"+id).Scan(&n)
//				return n, err
//			},
//		})
//	}
//
// Verify runs one schedule outside a test and returns its Report.
package idempotencytest
