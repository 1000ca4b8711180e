package outbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/testenv"
)

// TestRequestKeys records request keys in a batch, finds that a second recording of one
// leaves it as it was, answers, reads, forgets and purges them, and finds a job by an
// answered key only.
func TestRequestKeys(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ctx := testenv.Context(t, 20*time.Second)
	fp := idempotency.Fingerprint("debit", []byte(`{}`))
	a := outbox.RequestKey{Route: "POST /v1/debits", Key: "k-a", Fingerprint: fp, JobKey: "debit:a", TaskType: "debit", Code: 202, Body: []byte(`{"a":1}`)}
	b := outbox.RequestKey{Route: "POST /v1/debits", Key: "k-b", Fingerprint: fp, JobKey: "debit:b", TaskType: "debit", Code: 202, Body: []byte(`{"b":1}`)}

	record := func(keys ...outbox.RequestKey) map[outbox.RequestKeyID]bool {
		t.Helper()
		recorded := map[outbox.RequestKeyID]bool{}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			batch := &pgx.Batch{}
			outbox.QueueRecordRequestKeys(batch, keys, func(id outbox.RequestKeyID) { recorded[id] = true })
			return tx.SendBatch(ctx, batch).Close()
		})
		if err != nil {
			t.Fatal(err)
		}
		return recorded
	}
	if got := record(a, b); !got[a.ID()] || !got[b.ID()] || len(got) != 2 {
		t.Fatalf("recorded %v, want both keys", got)
	}
	again := a
	again.Body = []byte(`{"other":1}`)
	if got := record(again); len(got) != 0 {
		t.Fatalf("recorded %v again, want nothing", got)
	}

	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		answered := b
		answered.Code, answered.Body = 200, []byte(`{"duplicate":true}`)
		if err := outbox.AnswerRequestKeysTx(ctx, tx, []outbox.RequestKey{answered}); err != nil {
			return err
		}
		return outbox.ForgetRequestKeysTx(ctx, tx, []outbox.RequestKeyID{a.ID()})
	})
	if err != nil {
		t.Fatal(err)
	}
	var got map[outbox.RequestKeyID]outbox.RequestKey
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		got, err = outbox.ReadRequestKeysTx(ctx, tx, []outbox.RequestKeyID{a.ID(), b.ID()})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := got[a.ID()]; ok || len(got) != 1 {
		t.Fatalf("read %v, want only %v", got, b.ID())
	}
	if k := got[b.ID()]; k.Code != 200 || string(k.Body) != `{"duplicate":true}` || k.JobKey != b.JobKey || string(k.Fingerprint) != string(fp) {
		t.Errorf("read %+v, want %v answered 200", k, b.ID())
	}

	if typ, err := outbox.RequestKeyJob(ctx, pool, b.JobKey); err != nil || typ != "debit" {
		t.Errorf("RequestKeyJob(%s) = %q, %v; want debit", b.JobKey, typ, err)
	}
	if _, err := outbox.RequestKeyJob(ctx, pool, a.JobKey); !errors.Is(err, idempotency.ErrNotFound) {
		t.Errorf("RequestKeyJob(%s) = %v; want ErrNotFound (its key was forgotten)", a.JobKey, err)
	}

	if n, err := outbox.PurgeRequestKeys(ctx, pool, time.Hour); err != nil || n != 0 {
		t.Errorf("PurgeRequestKeys(1h) = %d, %v; want 0", n, err)
	}
	mustExec(t, pool, `UPDATE api_idempotency_keys SET created_at = now() - interval '2 hours'`)
	if n, err := outbox.PurgeRequestKeys(context.Background(), pool, time.Hour); err != nil || n != 1 {
		t.Errorf("PurgeRequestKeys(1h) = %d, %v; want 1", n, err)
	}
}
