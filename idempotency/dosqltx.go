package idempotency

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5/stdlib"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency/internal/sharedtx"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// DoSQLTx is DoTx for code that writes through database/sql (GORM, sqlx, ent, bun, sqlc):
// fn's writes through tx and the key's ledger row commit in one transaction, taken from
// Config.SQL (by default a *sql.DB over the ledger's own pool), with DoTx's guarantee, answers and errors. The transaction is the
// delivery's own (it is never shared), on the caller's goroutine: BEGIN, the key's
// advisory lock and its row's read (three round trips: database/sql sends one statement
// at a time), fn, then the row's fenced write and the COMMIT (three more).
//
// fn must do all its work through tx and must not end it: DoSQLTx commits or rolls it
// back. A tx fn committed or rolled back itself is reported as an error, and its effect,
// if it committed, went without the key's row (the next delivery would run it again).
// Config.SQL must run on pgx's stdlib or lib/pq (CheckSQL). Safe for concurrent use.
func (l *Ledger) DoSQLTx(ctx context.Context, req Request, fn func(ctx context.Context, tx *sql.Tx) (json.RawMessage, error)) (Result, error) {
	if err := req.validate(); err != nil {
		return Result{}, err
	}
	if err := l.CheckSQL(); err != nil {
		return Result{}, err
	}
	ctx, span := l.startSpan(ctx, "idemq.tx", req.Key)
	d := sharedtx.Delivery{Key: req.Key, TaskType: req.TaskType, Fingerprint: req.Fingerprint, IntentSum: req.intentSum(),
		Deadline: req.Deadline, SQL: fn}
	if sc := trace.SpanContextFromContext(ctx); sc.IsSampled() {
		d.TraceID = sc.TraceID().String()
	}
	o := l.tx.RunSQL(ctx, l.sqlDB, d)
	c, res, err := l.settle(ctx, req, &o)
	endTxSpan(span, c, res, err)
	return res, err
}

// CheckSQL reports whether Config.SQL can serve DoSQLTx: on pgx's stdlib or lib/pq (told
// from its driver's type, or vouched for with Config.SQLDriver). Any other driver is
// refused with a message naming its type. Without Config.SQL, the first call opens a
// *sql.DB over the ledger's pool (stdlib.OpenDBFromPool), which Close closes.
func (l *Ledger) CheckSQL() error {
	l.sqlOnce.Do(func() {
		l.sqlDB = l.cfg.SQL
		switch v := l.cfg.SQLDriver; {
		case l.sqlDB == nil:
			l.sqlDB, l.ownSQL = stdlib.OpenDBFromPool(l.pool), true
		case v == string(store.DriverPgx) || v == string(store.DriverPq):
		case v != "":
			l.sqlErr = fmt.Errorf("idempotency: Config.SQLDriver %q: must be \"pgx\" or \"pq\"", v)
		default:
			if _, err := store.SQLDriverOf(l.cfg.SQL); err != nil {
				l.sqlErr = fmt.Errorf("idempotency: Config.SQL: %w (or vouch for a wrapper with Config.SQLDriver)", err)
			}
		}
	})
	return l.sqlErr
}
