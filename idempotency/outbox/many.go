package outbox

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
)

// insertIntentsSQL records many intents in one statement, in the order given (key order,
// so that concurrent batches lock their rows in one order), held from the relays for $10
// ms when $10 > 0.
const insertIntentsSQL = `
INSERT INTO job_intents (idempotency_key, task_type, payload, payload_sha256, queue, max_retry, timeout_ms, retention_ms, trace_parent, relay_until)
SELECT u.k, u.t, u.p, u.f, u.q, u.m, u.o, u.r, nullif(u.tp, ''), CASE WHEN $10::bigint > 0 THEN now() + $10::bigint * interval '1 millisecond' END
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[], $5::text[], $6::int[], $7::bigint[], $8::bigint[], $9::text[]) AS u(k, t, p, f, q, m, o, r, tp)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING idempotency_key, state`

const readIntentsSQL = `SELECT idempotency_key, task_type, payload_sha256, state FROM job_intents WHERE idempotency_key = ANY($1::text[])`

// checkSpec refuses what EnqueueTx and EnqueueManyTx refuse before they reach Postgres.
func checkSpec(spec Spec) error {
	if err := idempotency.ValidateKey(spec.Key); err != nil {
		return err
	}
	if len(spec.Payload) > idempotency.MaxPayloadBytes {
		return fmt.Errorf("%w: payload of %s is %d bytes; the limit is %d", idempotency.ErrInvalidRequest, spec.Key, len(spec.Payload), idempotency.MaxPayloadBytes)
	}
	if spec.Type == "" || spec.Queue == "" {
		return fmt.Errorf("%w: %s: task type and queue are required", idempotency.ErrInvalidRequest, spec.Key)
	}
	return nil
}

// EnqueueManyTx records the intents of specs inside tx, as EnqueueTx records one, in two
// statements at most (one multi-row insert, and one read of the keys recorded before).
// It returns each spec's outcome at the spec's index: its result, or its own error (an
// invalid spec, a *MismatchError), which does not affect the others. The error it
// returns last is the statement's: then tx must be rolled back and nothing is recorded.
// A key given twice is recorded once; the second is its duplicate. Each spec's
// TraceParent is recorded as it is (ctx's span is not used: the specs may come from
// several requests).
//
// With selfPublish the caller publishes the new intents itself, with Publish once tx
// committed: the relays leave them alone for Config.RelayHold, then publish whatever is
// still pending (the caller crashed, say). Without it, call Wake after the commit.
func (c *Client) EnqueueManyTx(ctx context.Context, tx pgx.Tx, specs []Spec, selfPublish bool) ([]EnqueueResult, []error, error) {
	var hold time.Duration
	if selfPublish {
		hold = c.cfg.RelayHold
	}
	return enqueueMany(ctx, tx, specs, hold)
}

func enqueueMany(ctx context.Context, tx pgx.Tx, specs []Spec, hold time.Duration) ([]EnqueueResult, []error, error) {
	res, errs := make([]EnqueueResult, len(specs)), make([]error, len(specs))
	var order []int // the valid specs, by key
	for i, s := range specs {
		if errs[i] = checkSpec(s); errs[i] == nil {
			order = append(order, i)
		}
	}
	if len(order) == 0 {
		return res, errs, nil
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(specs[a].Key, specs[b].Key) })
	n := len(order)
	keys, types, queues := make([]string, n), make([]string, n), make([]string, n)
	payloads, fps, traces := make([][]byte, n), make([][]byte, n), make([]string, n)
	maxRetry, timeouts, retentions := make([]int32, n), make([]int64, n), make([]int64, n)
	for j, i := range order {
		s := specs[i]
		keys[j], types[j], queues[j], payloads[j], traces[j] = s.Key, s.Type, s.Queue, s.Payload, s.TraceParent
		fps[j] = idempotency.Fingerprint(s.Type, s.Payload)
		maxRetry[j], timeouts[j], retentions[j] = int32(s.MaxRetry), s.Timeout.Milliseconds(), s.Retention.Milliseconds()
	}
	rows, err := tx.Query(ctx, insertIntentsSQL, keys, types, payloads, fps, queues, maxRetry, timeouts, retentions, traces, hold.Milliseconds())
	if err != nil {
		return nil, nil, fmt.Errorf("outbox: record intents: %w", err)
	}
	inserted := make(map[string]string, n) // key → state
	var key, state string
	_, err = pgx.ForEachRow(rows, []any{&key, &state}, func() error {
		inserted[key] = state
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("outbox: record intents: %w", err)
	}
	var recorded []string // keys recorded before, or twice in specs
	for j, i := range order {
		if st, ok := inserted[keys[j]]; ok {
			res[i] = EnqueueResult{Key: keys[j], State: st}
			delete(inserted, keys[j]) // a second spec of the key is its duplicate
			continue
		}
		recorded = append(recorded, keys[j])
	}
	if len(recorded) == 0 {
		return res, errs, nil
	}
	type stored struct {
		typ   string
		fp    []byte
		state string
	}
	known := make(map[string]stored, len(recorded))
	rows, err = tx.Query(ctx, readIntentsSQL, PlanEach, recorded)
	if err != nil {
		return nil, nil, fmt.Errorf("outbox: read intents: %w", err)
	}
	var st stored
	_, err = pgx.ForEachRow(rows, []any{&key, &st.typ, &st.fp, &st.state}, func() error {
		known[key] = stored{st.typ, slices.Clone(st.fp), st.state}
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("outbox: read intents: %w", err)
	}
	for j, i := range order {
		if res[i].Key != "" {
			continue
		}
		k, ok := known[keys[j]]
		switch {
		case !ok: // cannot happen: the insert saw it
			errs[i] = fmt.Errorf("outbox: intent %s: neither recorded nor found", keys[j])
		case k.typ != types[j] || string(k.fp) != string(fps[j]):
			errs[i] = &idempotency.MismatchError{Key: keys[j]}
		default:
			res[i] = EnqueueResult{Key: keys[j], Duplicate: true, State: k.state}
		}
	}
	return res, errs, nil
}
