package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// exampleDB returns a pool on a fresh schema of the test database, migrated, and a
// function that closes it and drops the schema.
func exampleDB(context.Context) (*pgxpool.Pool, func()) { return testenv.ExamplePostgres(true) }

// DoTx puts the effect and the completion in one transaction: the second delivery of the
// same key gets the stored result and writes nothing.
func ExampleLedger_DoTx() {
	ctx := context.Background()
	pool, cleanup := exampleDB(ctx)
	defer cleanup()
	if _, err := pool.Exec(ctx, `CREATE TABLE example_entries (account_id text, amount_cents int, reference text)`); err != nil {
		log.Fatal(err)
	}

	ledger := idempotency.New(pool, nil)
	defer ledger.Close()
	payload := []byte(`{"account_id":"acct-1","amount_cents":500,"reference":"ref-42"}`)
	req := idempotency.Request{
		Key:         "debit:ref-42",
		TaskType:    "wallet:debit",
		Fingerprint: idempotency.Fingerprint("wallet:debit", payload),
	}
	for delivery := 1; delivery <= 2; delivery++ {
		res, err := ledger.DoTx(ctx, req, func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			_, err := tx.Exec(ctx, `INSERT INTO example_entries VALUES ('acct-1', -500, 'ref-42')`)
			return json.RawMessage(`{"debited":500}`), err
		})
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("delivery %d: cached=%t result=%s\n", delivery, res.Cached, res.Result)
	}
	var entries int
	pool.QueryRow(ctx, `SELECT count(*) FROM example_entries`).Scan(&entries)
	fmt.Println("entries:", entries)
	// Output:
	// delivery 1: cached=false result={"debited":500}
	// delivery 2: cached=true result={"debited": 500}
	// entries: 1
}

// Do runs an external effect under a heartbeated lease; the key in the context is the
// idempotency key to hand to the provider.
func ExampleLedger_Do() {
	ctx := context.Background()
	pool, cleanup := exampleDB(ctx)
	defer cleanup()
	ledger := idempotency.New(pool, nil)
	defer ledger.Close()

	charge := func(ctx context.Context) (json.RawMessage, error) {
		key, _, _ := idempotency.FromContext(ctx)
		fmt.Println("calling the provider with Idempotency-Key", key)
		return json.RawMessage(`{"charge_id":"ch_1"}`), nil
	}
	req := idempotency.Request{Key: "charge:order-123", TaskType: "payment:charge"}
	for range 2 {
		res, err := ledger.Do(ctx, req, charge)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("cached=%t result=%s\n", res.Cached, res.Result)
	}

	// Another payload under the same key is refused, never served the stored result.
	other := req
	other.Fingerprint = idempotency.Fingerprint("payment:charge", []byte(`{"amount_cents":1}`))
	req.Fingerprint = idempotency.Fingerprint("payment:charge", []byte(`{"amount_cents":2}`))
	req.Key, other.Key = "charge:order-124", "charge:order-124"
	ledger.Do(ctx, req, func(ctx context.Context) (json.RawMessage, error) { return nil, nil })
	_, err := ledger.Do(ctx, other, charge)
	fmt.Println(errors.Is(err, idempotency.ErrMismatch), err)
	// Output:
	// calling the provider with Idempotency-Key charge:order-123
	// cached=false result={"charge_id":"ch_1"}
	// cached=true result={"charge_id": "ch_1"}
	// true idempotency: key "charge:order-124" was claimed with another payload
}

// Claim, Complete and Fail are the steps Do takes, for callers that need them apart.
func ExampleLedger_Claim() {
	ctx := context.Background()
	pool, cleanup := exampleDB(ctx)
	defer cleanup()
	ledger := idempotency.New(pool, nil)
	defer ledger.Close()
	req := idempotency.Request{Key: "email:welcome-7", TaskType: "email:send"}

	first, err := ledger.Claim(ctx, req)
	if err != nil {
		log.Fatal(err)
	}
	_, err = ledger.Claim(ctx, req) // a duplicate while the first holds the lease
	var busy *idempotency.BusyError
	fmt.Println("duplicate busy:", errors.As(err, &busy), busy.Fence == first.Claim.Fence)

	if err := ledger.Complete(ctx, first.Claim, json.RawMessage(`{"sent":true}`)); err != nil {
		log.Fatal(err)
	}
	again, _ := ledger.Claim(ctx, req)
	fmt.Printf("after completion: %s\n", again.Completed.Result)

	rec, _ := ledger.Get(ctx, req.Key)
	fmt.Println(rec.Status, rec.Attempts)
	// Output:
	// duplicate busy: true true
	// after completion: {"sent": true}
	// completed 1
}

func ExampleValidateKey() {
	for _, key := range []string{"charge:order-123", "has space", ""} {
		fmt.Println(idempotency.ValidateKey(key))
	}
	// Output:
	// <nil>
	// idempotency: invalid key: byte 0x20 at offset 3, must be printable ASCII 0x21..0x7E (no space, control or non-ASCII)
	// idempotency: invalid key: empty, must be 1..255 bytes
}

// Step records an external effect's result inside a leased handler: the delivery after a
// failure gets it back without calling the provider again, and goes on to the next step.
func ExampleStep() {
	ctx := context.Background()
	pool, cleanup := exampleDB(ctx)
	defer cleanup()
	ledger := idempotency.New(pool, nil)
	defer ledger.Close()

	req := idempotency.Request{Key: "checkout:order-9", TaskType: "order:checkout"}
	for delivery := 1; delivery <= 2; delivery++ {
		res, err := ledger.Do(ctx, req, func(ctx context.Context) (json.RawMessage, error) {
			chargeID, err := idempotency.Step(ctx, "charge", func(ctx context.Context, stepKey string) (string, error) {
				fmt.Println("calling the provider with Idempotency-Key", stepKey)
				return "ch_9", nil
			}, idempotency.StepInput(map[string]int{"amount_cents": 900}))
			if err != nil {
				return nil, err
			}
			if delivery == 1 {
				return nil, errors.New("receipt service unavailable") // retried
			}
			return json.Marshal(map[string]string{"charge": chargeID})
		})
		fmt.Printf("delivery %d: %s %v\n", delivery, res.Result, err)
	}
	// Output:
	// calling the provider with Idempotency-Key checkout:order-9#s/charge
	// delivery 1:  receipt service unavailable
	// delivery 2: {"charge":"ch_9"} <nil>
}
