package server

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
)

// HandleOption changes how HandleTx and HandleLeased read a task of type T.
type HandleOption[T idempotency.Job] func(*handleConfig[T])

type handleConfig[T idempotency.Job] struct {
	decode func(payload []byte) (T, error)
}

// WithDecoder makes decode read the task's payload in place of the default (Decode). An
// error from it archives the task with the reason, with no ledger row.
func WithDecoder[T idempotency.Job](decode func(payload []byte) (T, error)) HandleOption[T] {
	return func(c *handleConfig[T]) { c.decode = decode }
}

// Decode is the payload decoder HandleTx and HandleLeased use by default:
// idempotency.DecodeStrict, then the job's Validate method when it has one
// (Validate() error, on T or *T).
func Decode[T idempotency.Job](payload []byte) (T, error) {
	v, err := idempotency.DecodeStrict[T](payload)
	if err != nil {
		return v, err
	}
	if j, ok := any(&v).(interface{ Validate() error }); ok {
		if err := j.Validate(); err != nil {
			var zero T
			return zero, err
		}
	}
	return v, nil
}

func decoder[T idempotency.Job](opts []HandleOption[T]) func([]byte) (T, error) {
	c := handleConfig[T]{decode: Decode[T]}
	for _, o := range opts {
		o(&c)
	}
	return c.decode
}

// Registrar is where HandleTx and HandleLeased register a job type: a *Server, or the
// worker and mux of a test harness (Mux), so that an application writes its registrations
// once, as a func(Registrar), for its server and for idempotencytest.Config.Handlers.
type Registrar interface {
	register(taskType string, handler func(w *asynqmw.Worker) asynq.Handler)
}

func (s *Server) register(taskType string, handler func(*asynqmw.Worker) asynq.Handler) {
	s.Handle(taskType, handler(s.worker))
}

// Mux returns the Registrar that registers on mux the handlers w serves: what a harness
// that makes its own workers (idempotency/idempotencytest) hands an application's
// registrations.
func Mux(w *asynqmw.Worker, mux *asynq.ServeMux) Registrar { return muxRegistrar{w, mux} }

type muxRegistrar struct {
	w   *asynqmw.Worker
	mux *asynq.ServeMux
}

func (m muxRegistrar) register(taskType string, handler func(*asynqmw.Worker) asynq.Handler) {
	if taskType == "" {
		panic("server: register: empty task type")
	}
	m.mux.Handle(taskType, handler(m.w))
}

// HandleTx registers fn for tasks of taskType as a transactional job
// (asynqmw.Transactional): fn's writes in tx and the key's completion commit in one
// transaction, so its effect happens exactly once. fn must do no external I/O, and may
// run more than once per delivery (its writes rolled back in between). The payload is
// read with Decode unless an option says otherwise. It panics if taskType is empty or
// already registered, or once Run has started.
func HandleTx[T idempotency.Job](r Registrar, taskType string, fn func(ctx context.Context, tx pgx.Tx, job T) (json.RawMessage, error), opts ...HandleOption[T]) {
	decode := decoder(opts)
	r.register(taskType, func(w *asynqmw.Worker) asynq.Handler { return asynqmw.Transactional(w, taskType, decode, fn) })
}

// HandleSQLTx registers fn for tasks of taskType as a transactional job whose handler
// writes through database/sql (asynqmw.TransactionalSQL): GORM, sqlx, ent, bun or sqlc
// over the *sql.Tx it is given. fn's writes and the key's completion commit in one
// transaction, taken from Config.SQL, with HandleTx's guarantee and refusals. fn must do
// no external I/O, must not commit or roll back tx, and may run more than once per
// delivery (its writes rolled back in between). Run refuses to start when Config.SQL's
// driver is neither pgx's stdlib nor lib/pq, naming it. It panics like HandleTx.
func HandleSQLTx[T idempotency.Job](r Registrar, taskType string, fn func(ctx context.Context, tx *sql.Tx, job T) (json.RawMessage, error), opts ...HandleOption[T]) {
	decode := decoder(opts)
	r.register(taskType, func(w *asynqmw.Worker) asynq.Handler { return asynqmw.TransactionalSQL(w, taskType, decode, fn) })
	if s, ok := r.(*Server); ok {
		s.mu.Lock()
		s.sqlHandlers = true
		s.mu.Unlock()
	}
}

// HandleLeased registers fn for tasks of taskType as a leased job (asynqmw.Leased): the
// claim commits first, fn runs under a heartbeated lease with the key in its context
// (idempotency.FromContext), to hand to an external provider as its idempotency key, and
// its result is completed, fenced. The payload is read with Decode unless an option says
// otherwise. It panics like HandleTx.
func HandleLeased[T idempotency.Job](r Registrar, taskType string, fn func(ctx context.Context, job T) (json.RawMessage, error), opts ...HandleOption[T]) {
	decode := decoder(opts)
	r.register(taskType, func(w *asynqmw.Worker) asynq.Handler { return asynqmw.Leased(w, taskType, decode, fn) })
}

// Handle registers h, as it is, for tasks of taskType: neither the lock nor the ledger
// guard it. HandleTx and HandleLeased register through it. It panics if taskType is
// empty or already registered, or once Run has started.
func (s *Server) Handle(taskType string, h asynq.Handler) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case taskType == "":
		panic("server: Handle: empty task type")
	case slices.Contains(s.types, taskType):
		panic(fmt.Sprintf("server: Handle: task type %q registered twice", taskType))
	case s.started:
		panic(fmt.Sprintf("server: Handle(%q) after Run", taskType))
	}
	s.mux.Handle(taskType, h)
	s.types = append(s.types, taskType)
}
