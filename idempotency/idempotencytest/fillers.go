package idempotencytest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
)

// The harness's own task types: deliveries that share the shared-batch schedule's commits
// with the case's. One of each kind fails its first run.
const (
	fillerTx     = "idemqtest:filler-tx"
	fillerLeased = "idemqtest:filler-leased"
)

type filler struct {
	ID   string `json:"id"`
	Fail bool   `json:"fail"`
}

func (f filler) Key() string       { return "idemqtest-filler:" + f.ID }
func (f filler) LockScope() string { return "" }

func decodeFiller(b []byte) (filler, error) {
	var f filler
	if err := json.Unmarshal(b, &f); err != nil || f.ID == "" {
		return filler{}, fmt.Errorf("filler payload %q: %v", b, err)
	}
	return f, nil
}

var errFillerFails = errors.New("idemqtest: a filler's first run fails")

func registerFillers(w *asynqmw.Worker, mux *asynq.ServeMux) {
	mux.Handle(fillerTx, asynqmw.Transactional(w, fillerTx, decodeFiller, func(ctx context.Context, tx pgx.Tx, f filler) (json.RawMessage, error) {
		if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
			return nil, err
		}
		if n, _ := asynq.GetRetryCount(ctx); f.Fail && n == 0 {
			return nil, errFillerFails
		}
		return json.RawMessage(`{"filler":true}`), nil
	}))
	mux.Handle(fillerLeased, asynqmw.Leased(w, fillerLeased, decodeFiller, func(ctx context.Context, f filler) (json.RawMessage, error) {
		if n, _ := asynq.GetRetryCount(ctx); f.Fail && n == 0 {
			return nil, errFillerFails
		}
		return json.RawMessage(`{"filler":true}`), nil
	}))
}

// enqueueFillers publishes six fillers, three of each kind, one of each failing once.
func (r *run) enqueueFillers(ctx context.Context) error {
	c := r.client()
	for i := range 6 {
		typ := fillerTx
		if i%2 == 1 {
			typ = fillerLeased
		}
		f := filler{ID: fmt.Sprintf("%s-%d", r.id, i), Fail: i < 2}
		payload, _ := json.Marshal(f)
		t := asynq.NewTaskWithHeaders(typ, payload, idempotency.FirstEnqueuedHeader(time.Now()))
		if _, err := c.EnqueueContext(ctx, t, asynq.Queue(r.queue), asynq.TaskID("filler-"+f.ID), asynq.MaxRetry(50)); err != nil {
			return err
		}
		r.fillers++
	}
	return nil
}

// waitFillers waits until every filler succeeded.
func (r *run) waitFillers(ctx context.Context) error {
	return r.waitFor(ctx, "the other deliveries of the shared batch to succeed", func() bool { return len(r.fillersOK) == r.fillers })
}
