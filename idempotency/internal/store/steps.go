package store

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// The recorded steps of leased jobs (processed_job_steps): one row per key, generation
// and step, written only under a fenced row lock (FOR SHARE) of the key's processed_jobs row.

// StepParams is one step to record under a claim (key, fence, owner, generation).
type StepParams struct {
	Key        string
	Fence      int64
	Owner      pgtype.UUID
	Generation int32
	Step       string
	Seq        int32
	// InputFingerprint is the step's input fingerprint, nil for none (NULL).
	InputFingerprint []byte
	// Result is the step's result as JSON text (NULL when not valid).
	Result pgtype.Text
}

// StepRow is a recorded step.
type StepRow struct {
	Step             string
	Seq              int32
	Fence            int64
	InputFingerprint []byte
	Result           []byte    // jsonb's text, nil for NULL
	CreatedAt        time.Time // when it was recorded, on the database clock
}

var (
	// ReadStepsSQL reads the steps recorded for a key's generation (read_steps.sql).
	ReadStepsSQL = sqlText("read_steps", nil)
	// ShowStepsSQL reads the steps of a key's current generation in the order the run
	// called them (show_steps.sql).
	ShowStepsSQL = sqlText("show_steps", nil)
)

type querier interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}

// ReadSteps returns the steps recorded for key's generation, in no particular order.
func ReadSteps(ctx context.Context, q querier, key string, generation int32) ([]StepRow, error) {
	return scanSteps(q.Query(ctx, ReadStepsSQL, key, generation))
}

// ShowSteps returns the steps of key's current generation in seq order: none when the
// ledger does not hold key or its generation recorded none.
func ShowSteps(ctx context.Context, q querier, key string) ([]StepRow, error) {
	return scanSteps(q.Query(ctx, ShowStepsSQL, key))
}

// scanSteps reads the rows of a query of stepColumns.
func scanSteps(rows pgx.Rows, err error) ([]StepRow, error) {
	if err != nil {
		return nil, err
	}
	var out []StepRow
	var r StepRow
	_, err = pgx.ForEachRow(rows, []any{&r.Step, &r.Seq, &r.Fence, &r.InputFingerprint, &r.Result, &r.CreatedAt}, func() error {
		out = append(out, r)
		r = StepRow{}
		return nil
	})
	return out, err
}

// RecordStep records p's step in one statement, fenced: recorded is false (and nothing
// written) when p's claim no longer holds the key.
func (w *Writes) RecordStep(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, p StepParams) (recorded bool, err error) {
	tag, err := q.Exec(ctx, w.RecordStepSQL, p.Key, p.Fence, p.Owner, p.Generation, p.Step, p.Seq, p.InputFingerprint, p.Result)
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() == 1, nil
}

// HoldStep takes the fenced row lock that opens a step's transaction tx: held is false when
// p's claim no longer holds the key (then roll tx back).
func (w *Writes) HoldStep(ctx context.Context, tx pgx.Tx, p StepParams) (held bool, err error) {
	tag, err := tx.Exec(ctx, w.HoldStepSQL, p.Key, p.Fence, p.Owner, p.Generation)
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() == 1, nil
}

// InsertStep writes p's step row in tx, after HoldStep held the key.
func (w *Writes) InsertStep(ctx context.Context, tx pgx.Tx, p StepParams) error {
	_, err := tx.Exec(ctx, w.InsertStepSQL, p.Key, p.Generation, p.Step, p.Seq, p.Fence, p.InputFingerprint, p.Result)
	return err
}
