package outbox

import (
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/idempotency"
)

// Spec is everything needed to publish a job: its key, its asynq task type and payload,
// and asynq's options. The outbox stores it and publishes it later (Spec.Task).
type Spec struct {
	Key       string
	Type      string
	Payload   []byte
	Queue     string
	MaxRetry  int
	Timeout   time.Duration
	Retention time.Duration
}

// Task returns the asynq task for s under TaskID taskID (the key for the first publish),
// with the first-enqueue header set to firstEnqueued and s's options; opts come last and
// win.
func (s Spec) Task(taskID string, firstEnqueued time.Time, opts ...asynq.Option) *asynq.Task {
	all := append([]asynq.Option{
		asynq.TaskID(taskID),
		asynq.Queue(s.Queue),
		asynq.MaxRetry(s.MaxRetry),
		asynq.Timeout(s.Timeout),
		asynq.Retention(s.Retention),
	}, opts...)
	return asynq.NewTaskWithHeaders(s.Type, s.Payload, idempotency.FirstEnqueuedHeader(firstEnqueued), all...)
}
