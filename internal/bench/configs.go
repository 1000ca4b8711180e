package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/handlers"
	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/unguarded"
	"github.com/idemq/idemq/tasks"
)

// The configurations, in the order each repetition runs them.
const (
	ConfigBare      = "A" // bare asynq around the business function
	ConfigLock      = "B" // + Redis lock (lock.Obtain / Release)
	ConfigLedger    = "C" // + ledger, leased mode (Ledger.Do)
	ConfigLedgerTx  = "D" // + ledger, transactional mode (Ledger.DoTx)
	ConfigFull      = "E" // full stack, leased (asynqmw.Leased)
	ConfigFullTx    = "F" // full stack, transactional (asynqmw.Transactional)
	ConfigFullLock  = "G" // full stack, leased, taking the Redis lock on a key-scoped job too
	typeNoop        = "bench:noop"
	lockTTL         = 30 * time.Second
	noopTaskTimeout = 30 * time.Second
)

// ConfigNames describes each configuration.
var ConfigNames = map[string]string{
	ConfigBare:     "bare asynq",
	ConfigLock:     "+ Redis lock",
	ConfigLedger:   "+ ledger leased (Do)",
	ConfigLedgerTx: "+ ledger tx (DoTx)",
	ConfigFull:     "full stack leased",
	ConfigFullTx:   "full stack tx",
	ConfigFullLock: "full stack leased, key lock",
}

// noopJob is the payload of the no-op workload: a key, scoped to itself.
type noopJob struct {
	ID string `json:"id"`
}

func (j noopJob) Key() string       { return "noop:" + j.ID }
func (j noopJob) LockScope() string { return j.Key() }

var _ idempotency.Job = noopJob{}

func decodeNoop(b []byte) (noopJob, error) {
	var j noopJob
	if err := json.Unmarshal(b, &j); err != nil {
		return j, err
	}
	if j.ID == "" {
		return j, errors.New("id: required")
	}
	return j, nil
}

// innerKey carries, in a delivery's context, where the business function adds the time
// it took; the recorder subtracts it from the delivery's time to get the overhead.
type innerKey struct{}

func addInner(ctx context.Context, since time.Time) {
	if p, ok := ctx.Value(innerKey{}).(*time.Duration); ok {
		*p += time.Since(since)
	}
}

// workload is one kind of task and what each configuration runs for it.
type workload struct {
	name     string
	taskType string
	configs  []string
	// spec returns task i of a measurement whose keys start with prefix.
	spec func(prefix string, i int) outbox.Spec
	// taskID, if set, is task i's asynq TaskID (default: its key).
	taskID func(s outbox.Spec, i int) string
	// handler returns the asynq handler of config on st.
	handler func(config string, st *stack) asynq.Handler
	// rate, when positive, makes the measurement paced: the servers start first and the
	// tasks arrive at rate per second, so that the overhead is measured without a queue.
	rate float64
	// concurrency, when positive, replaces Options.Concurrency for this workload.
	concurrency int
}

// parts are a workload's pieces: its decoder and business function, leased (no tx)
// and/or transactional.
type parts[T idempotency.Job] struct {
	taskType string
	decode   func([]byte) (T, error)
	leased   func(ctx context.Context, job T) (json.RawMessage, error)
	tx       func(ctx context.Context, tx pgx.Tx, job T) (json.RawMessage, error)
	// bareRaw makes the bare configuration call leased without decoding the payload
	// (the no-op handler of bare asynq).
	bareRaw bool
}

func (p parts[T]) handler(config string, st *stack) asynq.Handler {
	switch config {
	case ConfigBare:
		if p.bareRaw {
			return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
				var zero T
				_, err := p.leased(ctx, zero)
				return err
			})
		}
		if p.leased != nil {
			return unguarded.Leased(p.taskType, p.decode, p.leased)
		}
		return unguarded.Transactional(st.pool, p.taskType, p.decode, p.tx)
	case ConfigLock:
		// The bare handler under the lock of the job's scope (so a real handler's payload
		// is decoded twice: once here for the scope, once by the bare handler).
		bare := p.handler(ConfigBare, st)
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			job, err := p.decode(t.Payload())
			if err != nil {
				return fmt.Errorf("%s: %v: %w", p.taskType, err, asynq.SkipRetry)
			}
			lk, err := st.locker.Obtain(ctx, job.LockScope(), lockTTL, nil)
			if err != nil {
				return err
			}
			defer lk.Release(context.WithoutCancel(ctx))
			return bare.ProcessTask(ctx, t)
		})
	case ConfigLedger:
		return p.decoded(func(ctx context.Context, job T) error {
			_, err := st.ledger.Do(ctx, request(ctx, p.taskType, job), func(ctx context.Context) (json.RawMessage, error) {
				return p.leased(ctx, job)
			})
			return err
		})
	case ConfigLedgerTx:
		return p.decoded(func(ctx context.Context, job T) error {
			_, err := st.ledger.DoTx(ctx, request(ctx, p.taskType, job), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
				return p.tx(ctx, tx, job)
			})
			return err
		})
	case ConfigFull:
		return asynqmw.Leased(st.worker, p.taskType, p.decode, p.leased)
	case ConfigFullTx:
		return asynqmw.Transactional(st.worker, p.taskType, p.decode, p.tx)
	case ConfigFullLock:
		return asynqmw.Leased(st.keyWorker, p.taskType, p.decode, p.leased)
	}
	panic("bench: unknown configuration " + config)
}

func (p parts[T]) decoded(run func(ctx context.Context, job T) error) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		job, err := p.decode(t.Payload())
		if err != nil {
			return fmt.Errorf("%s: %v: %w", p.taskType, err, asynq.SkipRetry)
		}
		return run(ctx, job)
	})
}

func request(ctx context.Context, taskType string, job idempotency.Job) idempotency.Request {
	r := idempotency.Request{Key: job.Key(), TaskType: taskType}
	if d, ok := ctx.Deadline(); ok {
		r.Deadline = d
	}
	return r
}

// noopWorkload does nothing, or sleeps for work (simulated I/O), in every configuration.
func noopWorkload(name string, work time.Duration) *workload {
	leased := func(ctx context.Context, _ noopJob) (json.RawMessage, error) {
		start := time.Now()
		if work > 0 {
			time.Sleep(work)
		}
		addInner(ctx, start)
		return nil, nil
	}
	p := parts[noopJob]{
		taskType: typeNoop,
		decode:   decodeNoop,
		leased:   leased,
		tx:       func(ctx context.Context, _ pgx.Tx, j noopJob) (json.RawMessage, error) { return leased(ctx, j) },
		bareRaw:  true,
	}
	configs := []string{ConfigBare, ConfigLock, ConfigLedger, ConfigLedgerTx, ConfigFull, ConfigFullTx}
	if work > 0 {
		configs = []string{ConfigBare, ConfigFull, ConfigFullTx}
	}
	return &workload{
		name: name, taskType: typeNoop, configs: configs, handler: p.handler,
		spec: func(prefix string, i int) outbox.Spec {
			j := noopJob{ID: fmt.Sprintf("%s-%d", prefix, i)}
			b, _ := json.Marshal(j)
			return outbox.Spec{Key: j.Key(), Type: typeNoop, Payload: b, Queue: tasks.Queue,
				MaxRetry: tasks.DefaultMaxRetry, Timeout: noopTaskTimeout, Retention: tasks.DefaultRetention}
		},
	}
}

// debitWorkload is the real wallet:debit handler (transactional): bare asynq runs it in
// a plain transaction.
func debitWorkload() *workload {
	debit := func(ctx context.Context, tx pgx.Tx, d tasks.Debit) (json.RawMessage, error) {
		start := time.Now()
		defer addInner(ctx, start)
		return handlers.Debit(ctx, tx, d)
	}
	p := parts[tasks.Debit]{taskType: tasks.TypeDebit, decode: tasks.DecodeDebit, tx: debit}
	return &workload{
		name: "debit", taskType: tasks.TypeDebit, handler: p.handler,
		configs: []string{ConfigBare, ConfigLock, ConfigLedgerTx, ConfigFullTx},
		spec: func(prefix string, i int) outbox.Spec {
			s, err := tasks.DebitSpec(tasks.Debit{AccountID: fmt.Sprintf("acct-%s-%d", prefix, i), AmountCents: 100 + int64(i%900), Reference: fmt.Sprintf("%s-%d", prefix, i)})
			if err != nil {
				panic(err)
			}
			return s
		},
	}
}

// chargeWorkload is the real payment:charge handler (leased): an HTTP call to the
// in-process provider, which records the request and the charge in Postgres.
func chargeWorkload(charger *handlers.Charger) *workload {
	charge := func(ctx context.Context, c tasks.Charge) (json.RawMessage, error) {
		start := time.Now()
		defer addInner(ctx, start)
		return charger.Charge(ctx, c.Key(), c)
	}
	p := parts[tasks.Charge]{taskType: tasks.TypeCharge, decode: tasks.DecodeCharge, leased: charge}
	return &workload{
		name: "charge", taskType: tasks.TypeCharge, handler: p.handler,
		configs: []string{ConfigBare, ConfigLock, ConfigLedger, ConfigFull},
		spec: func(prefix string, i int) outbox.Spec {
			s, err := tasks.ChargeSpec(tasks.Charge{OrderID: fmt.Sprintf("%s-%d", prefix, i), CustomerID: fmt.Sprintf("cust-%s-%d", prefix, i), AmountCents: 500 + int64(i%900), Currency: "EUR"})
			if err != nil {
				panic(err)
			}
			return s
		},
	}
}

// latencyWorkload is the no-op workload at a steady, low arrival rate and concurrency 10:
// what each task pays when nothing queues (the unloaded overhead).
func latencyWorkload(rate float64) *workload {
	w := noopWorkload("latency", 0)
	w.configs = []string{ConfigBare, ConfigFull, ConfigFullTx}
	w.rate, w.concurrency = rate, 10
	return w
}

// dupWorkload is the no-op workload with every key delivered three times at once, under
// three TaskIDs (as duplicate enqueues and redeliveries arrive): bare asynq runs each
// delivery; the full stack runs each key once and answers the others from the ledger,
// with (G) or without (E) the Redis lock on the key.
func dupWorkload() *workload {
	w := noopWorkload("dup", 0)
	base := w.spec
	w.configs = []string{ConfigBare, ConfigFull, ConfigFullLock}
	w.spec = func(prefix string, i int) outbox.Spec { return base(prefix, i/3) }
	w.taskID = func(s outbox.Spec, i int) string { return fmt.Sprintf("%s#d%d", s.Key, i%3) }
	return w
}
