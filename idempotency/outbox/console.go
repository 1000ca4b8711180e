package outbox

import (
	"context"

	"github.com/idemq/idemq/idempotency/internal/store"
)

// IntentTask is where the tasks of a job recorded through the outbox are: the queue its
// intent names, and how many times the relays or the reconciler republished it.
type IntentTask struct {
	Key               string
	Queue             string
	PublishGeneration int
}

// TaskIDs are the asynq TaskIDs the job was published under, first to current: the key,
// then key#r1 … key#r<n>.
func (t IntentTask) TaskIDs() []string {
	ids := make([]string, 0, t.PublishGeneration+1)
	for gen := 0; gen <= t.PublishGeneration; gen++ {
		ids = append(ids, taskID(t.Key, gen))
	}
	return ids
}

// IntentTasks returns the IntentTask of each of keys that has an intent, by key, in one
// statement; the others are absent from the map. Safe for concurrent use when q is (a
// pool is).
func IntentTasks(ctx context.Context, q DB, keys []string) (map[string]IntentTask, error) {
	got, err := store.IntentTasks(ctx, q, keys)
	out := make(map[string]IntentTask, len(got))
	for key, it := range got {
		out[key] = IntentTask{Key: key, Queue: it.Queue, PublishGeneration: it.PublishGeneration}
	}
	return out, err
}
