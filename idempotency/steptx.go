package idempotency

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency/internal/claimctx"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// StepTx runs fn, a database effect, in a transaction of its own on the ledger's pool that
// also records the step: the transaction begins with a fenced row lock of the job's row
// (so a takeover of the key waits for it, or it fails because a takeover came first),
// runs fn, writes the step's record and commits. A claim that no longer holds the key
// writes nothing (an error wrapping ErrLeaseLost); an error of fn, or the end of ctx
// (the handler's, cancelled when its lease is lost), rolls everything back. A later
// delivery gets the recorded result without running fn, as for Step, whose rules
// (names, order, StepInput, errors) it shares.
//
// The transaction holds the job's row lock from its first statement to its commit, which
// also delays the handler's heartbeats: keep it short, well inside the lease. No external
// I/O in fn, and no step calls (they are refused: their records would wait for that row
// lock). Unlike Step, StepTx has no gap between effect and record.
func StepTx[T any](ctx context.Context, name string, fn func(ctx context.Context, tx pgx.Tx) (T, error), opts ...StepOption) (T, error) {
	t := &pgxStep{}
	return hooked(ctx, name, true, func(h claimctx.StepHook) (T, bool, error) {
		return stepTx(ctx, name, t, func(ctx context.Context) (T, error) { return fn(ctx, t.tx) }, opts, h)
	})
}

// stepTxn is the transaction a StepTx call runs in: pgx's (StepTx) or database/sql's
// (StepSQLTx). within runs body in a new transaction on l's database, which commits when
// body returns nil and rolls back otherwise; hold and insert send the step's statements
// in it.
type stepTxn interface {
	within(ctx context.Context, l *Ledger, body func() error) error
	hold(ctx context.Context, w *store.Writes, p store.StepParams) (bool, error)
	insert(ctx context.Context, w *store.Writes, p store.StepParams) error
}

// pgxStep is StepTx's transaction, on the ledger's pool.
type pgxStep struct{ tx pgx.Tx }

func (s *pgxStep) within(ctx context.Context, l *Ledger, body func() error) error {
	return pgx.BeginFunc(ctx, l.pool, func(tx pgx.Tx) error {
		s.tx = tx
		return body()
	})
}

func (s *pgxStep) hold(ctx context.Context, w *store.Writes, p store.StepParams) (bool, error) {
	return w.HoldStep(ctx, s.tx, p)
}

func (s *pgxStep) insert(ctx context.Context, w *store.Writes, p store.StepParams) error {
	return w.InsertStep(ctx, s.tx, p)
}

// stepTx is StepTx in txn, fn the step's work on it; cached reports a step that an
// earlier delivery recorded.
func stepTx[T any](ctx context.Context, name string, txn stepTxn, fn func(ctx context.Context) (T, error), opts []StepOption, h claimctx.StepHook) (v T, cached bool, err error) {
	run, err := stepRunOf(ctx, name)
	if err != nil {
		return v, false, err
	}
	ctx, span := run.l.startSpan(ctx, "idemq.step", run.c.Key)
	call, done, err := run.begin(ctx, name, opts)
	defer func() { run.end(span, name, call, done, err) }()
	if err != nil || done != nil {
		v, err = decodeStep[T](run, name, done, err)
		return v, err == nil, err
	}
	var b []byte
	var fnErr error // fn's error, or its result's: returned as is
	err = txn.within(ctx, run.l, func() error {
		p := run.holdParams(call)
		held, err := txn.hold(ctx, run.l.writes, p)
		if err != nil {
			return err
		}
		if !held {
			return run.leaseLost(name)
		}
		v, err := fn(context.WithValue(ctx, inStepTxKey{}, name))
		if err == nil {
			b, p, err = run.params(call, v)
		}
		if err != nil {
			fnErr = err
			return err
		}
		if err := txn.insert(ctx, run.l.writes, p); err != nil {
			return err
		}
		if h != nil {
			h.Effected(ctx, name, true)
		}
		return nil
	})
	if err != nil {
		if fnErr == nil && !errors.Is(err, ErrLeaseLost) {
			err = asUnavailable(ctx, fmt.Errorf("idempotency: step %q of %s: %w", name, run.c.Key, err))
		}
		return v, false, withLeaseLoss(err, ctx)
	}
	v, err = recordedStep[T](run, call, b)
	return v, false, err
}

// StepSQLTx is StepTx for code that writes through database/sql: fn's writes through tx
// and the step's record commit in one transaction, taken from the ledger's Config.SQL
// (see DoSQLTx), which begins with the same fenced row lock of the job's row. Its rules,
// answers and errors are StepTx's. fn must not commit or roll back tx.
func StepSQLTx[T any](ctx context.Context, name string, fn func(ctx context.Context, tx *sql.Tx) (T, error), opts ...StepOption) (T, error) {
	t := &sqlStep{}
	return hooked(ctx, name, true, func(h claimctx.StepHook) (T, bool, error) {
		return stepTx(ctx, name, t, func(ctx context.Context) (T, error) { return fn(ctx, t.tx) }, opts, h)
	})
}

// sqlStep is StepSQLTx's transaction, on the ledger's *sql.DB.
type sqlStep struct{ tx *sql.Tx }

func (s *sqlStep) within(ctx context.Context, l *Ledger, body func() error) error {
	if err := l.CheckSQL(); err != nil {
		return err
	}
	tx, err := l.sqlDB.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return store.SQLError(err)
	}
	s.tx = tx
	if err := body(); err != nil {
		_ = tx.Rollback()
		return err
	}
	return store.SQLError(tx.Commit())
}

func (s *sqlStep) hold(ctx context.Context, w *store.Writes, p store.StepParams) (bool, error) {
	return w.HoldStepDB(ctx, s.tx, p)
}

func (s *sqlStep) insert(ctx context.Context, w *store.Writes, p store.StepParams) error {
	return w.InsertStepDB(ctx, s.tx, p)
}
