package asynqmw_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/internal/metrics"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/lock"
	"github.com/idemq/idemq/tasks"
)

// BenchmarkTransactionalDelivery runs one new debit per iteration through Transactional,
// as the worker does (a logger at Info level, metrics), against the real Postgres and
// Redis: its time is mostly theirs, its allocations the process's own.
func BenchmarkTransactionalDelivery(b *testing.B) {
	ledger, _ := newLedger(b, &idempotency.Config{Lease: 5 * time.Second})
	m := metrics.New()
	w := asynqmw.NewWorker(ledger, lock.New(testenv.Redis(b), nil), &asynqmw.Config{
		Logger:         slog.New(slog.NewJSONHandler(io.Discard, nil)),
		ObserveHandler: m.ObserveHandler,
	})
	h := asynqmw.Transactional(w, tasks.TypeDebit, tasks.DecodeDebit, func(ctx context.Context, tx pgx.Tx, d tasks.Debit) (json.RawMessage, error) {
		return json.RawMessage(`{"debit":"` + d.Reference + `"}`), nil
	})
	ctx := testenv.Context(b, 10*time.Minute)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		i++
		task, err := tasks.NewDebitTask(tasks.Debit{AccountID: "a-" + strconv.Itoa(i%8), AmountCents: 250, Reference: "r-" + strconv.Itoa(i)})
		if err != nil {
			b.Fatal(err)
		}
		if err := h.ProcessTask(ctx, task); err != nil {
			b.Fatal(err)
		}
	}
}
