package idempotency

import (
	"context"
	"crypto/sha256"
	"fmt"
	"strconv"
	"strings"

	"github.com/idemq/idemq/idempotency/internal/store"
)

// An outbox intent (package outbox) is settled only by a delivery of its own task: the
// task the outbox published under TaskID key (or key#r<n> after n republishes) with the
// intent's payload bytes. A delivery of another producer's task for the same key (a plain
// asynq producer's, another payload's) never settles it, so a job accepted with one
// payload is never reported done because another payload's job completed its key.

// IntentKey returns the key whose outbox intent a task with TaskID id would belong to:
// id itself, or key for key#r<n> (n ≥ 1, as the outbox's republishes are named). ok is
// false when id cannot be such a TaskID.
func IntentKey(id string) (key string, ok bool) {
	key, gen, republished := strings.Cut(id, "#r")
	if republished {
		n, err := strconv.Atoi(gen)
		if err != nil || n < 1 || strconv.Itoa(n) != gen {
			return "", false
		}
	}
	if ValidateKey(key) != nil {
		return "", false
	}
	return key, true
}

// PayloadSum is the value for Request.PayloadSum: the Fingerprint of a task's type and
// its payload bytes as delivered (not of the canonical payload: the outbox records the
// caller's bytes, and publishes them as they are).
func PayloadSum(taskType string, payload []byte) []byte {
	return Fingerprint(taskType, payload)
}

// intentSum is what req's finish passes as store.FinishParams.IntentSum: nil when the
// caller named no task (any completion settles the key's intent), the payload's sum when
// the task is the intent's own by its TaskID, and an empty sum (settles nothing)
// otherwise.
func (r *Request) intentSum() []byte {
	if r.TaskID == "" {
		return nil
	}
	if key, ok := IntentKey(r.TaskID); !ok || key != r.Key || len(r.PayloadSum) != sha256.Size {
		return []byte{}
	}
	return r.PayloadSum
}

// Reasons a delivery settles its intent dead, for Config-level counters such as
// idemq_intents_dead_total{reason}.
const (
	IntentDeadMismatch       = "mismatch"        // its key was completed (or claimed) with another payload
	IntentDeadFailed         = "failed"          // its key failed for good
	IntentDeadNeedsAttention = "needs_attention" // its key is stuck until an operator acts
	IntentDeadInvalid        = "invalid"         // the worker refused its payload or key
)

// SettleIntent settles the outbox intent of req's key for a delivery whose answer came
// from the ledger without a completion of its own: done for a cached result (dead false),
// dead with reason for a mismatch, a failed or stuck row, or a payload the worker refused
// (its key then comes from the TaskID: see IntentKey). Only a delivery of the intent's own
// task settles it (req.TaskID and req.PayloadSum; see Request); it reports whether it
// did. An intent already settled is left as it is. An error that says Postgres could not
// be reached or did not answer in time wraps ErrUnavailable. Safe for concurrent use.
func (l *Ledger) SettleIntent(ctx context.Context, req Request, dead bool, reason string) (bool, error) {
	sum := req.intentSum()
	if len(sum) == 0 {
		return false, nil
	}
	state := store.IntentDone
	if dead {
		state = store.IntentDead
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
	defer cancel()
	ok, err := store.SettleIntent(wctx, l.pool, req.Key, req.TaskType, sum, state, cleanText(reason))
	if err != nil {
		return false, asUnavailable(ctx, fmt.Errorf("idempotency: settle the intent of %s: %w", req.Key, err))
	}
	return ok, nil
}
