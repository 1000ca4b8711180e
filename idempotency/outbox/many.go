package outbox

import (
	"bytes"
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// checkSpec refuses what EnqueueTx and EnqueueManyTx refuse before they reach Postgres.
func checkSpec(spec Spec) error {
	if err := idempotency.ValidateKey(spec.Key); err != nil {
		return err
	}
	if len(spec.Payload) > idempotency.MaxPayloadBytes {
		return fmt.Errorf("%w: payload of %s is %d bytes; the limit is %d", idempotency.ErrInvalidRequest, spec.Key, len(spec.Payload), idempotency.MaxPayloadBytes)
	}
	if spec.Type == "" {
		return fmt.Errorf("%w: %s: a task type is required", idempotency.ErrInvalidRequest, spec.Key)
	}
	for _, name := range spec.Steps {
		if _, err := idempotency.StepKey(spec.Key, name); err != nil {
			return err
		}
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
	return enqueueMany(ctx, pgxIntents{tx}, specs, hold)
}

// intentTx is the caller's transaction the intents are recorded in: pgx's or
// database/sql's.
type intentTx interface {
	insert(ctx context.Context, ps []store.IntentParams, hold time.Duration) (map[string]string, error)
	read(ctx context.Context, keys []string) (map[string]store.RecordedIntent, error)
}

type pgxIntents struct{ tx pgx.Tx }

func (t pgxIntents) insert(ctx context.Context, ps []store.IntentParams, hold time.Duration) (map[string]string, error) {
	return store.InsertIntents(ctx, t.tx, ps, hold)
}

func (t pgxIntents) read(ctx context.Context, keys []string) (map[string]store.RecordedIntent, error) {
	return store.ReadIntents(ctx, t.tx, keys)
}

type sqlIntents struct{ tx *sql.Tx }

func (t sqlIntents) insert(ctx context.Context, ps []store.IntentParams, hold time.Duration) (map[string]string, error) {
	return store.InsertIntentsDB(ctx, t.tx, ps, hold)
}

func (t sqlIntents) read(ctx context.Context, keys []string) (map[string]store.RecordedIntent, error) {
	return store.ReadIntentsDB(ctx, t.tx, keys)
}

// enqueueMany is EnqueueManyTx in tx.
func enqueueMany(ctx context.Context, tx intentTx, specs []Spec, hold time.Duration) ([]EnqueueResult, []error, error) {
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
	ps := make([]store.IntentParams, len(order))
	for j, i := range order {
		s := specs[i].withDefaults()
		ps[j] = store.IntentParams{Key: s.Key, TaskType: s.Type, Payload: s.Payload, Fingerprint: idempotency.Fingerprint(s.Type, s.Payload),
			Queue: s.Queue, MaxRetry: s.MaxRetry, Timeout: s.Timeout, Retention: s.Retention, TraceParent: s.TraceParent}
	}
	inserted, err := tx.insert(ctx, ps, hold) // key → state
	if err != nil {
		return nil, nil, fmt.Errorf("outbox: record intents: %w", err)
	}
	var recorded []string // keys recorded before, or twice in specs
	for j, i := range order {
		if st, ok := inserted[ps[j].Key]; ok {
			res[i] = EnqueueResult{Key: ps[j].Key, State: st}
			delete(inserted, ps[j].Key) // a second spec of the key is its duplicate
			continue
		}
		recorded = append(recorded, ps[j].Key)
	}
	if len(recorded) == 0 {
		return res, errs, nil
	}
	known, err := tx.read(ctx, recorded)
	if err != nil {
		return nil, nil, fmt.Errorf("outbox: read intents: %w", err)
	}
	for j, i := range order {
		if res[i].Key != "" {
			continue
		}
		p := ps[j]
		k, ok := known[p.Key]
		switch {
		case !ok: // cannot happen: the insert saw it
			errs[i] = fmt.Errorf("outbox: intent %s: neither recorded nor found", p.Key)
		case k.TaskType != p.TaskType || !bytes.Equal(k.Fingerprint, p.Fingerprint):
			errs[i] = &idempotency.MismatchError{Key: p.Key}
		default:
			res[i] = EnqueueResult{Key: p.Key, Duplicate: true, State: k.State}
		}
	}
	return res, errs, nil
}
