package main

import (
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/tasks"
)

// TestWorkerOwnsItsQueues: your own service and idemq worker on one Redis. A plain asynq
// producer's task of a type the worker does not run, on a queue of its own that the worker
// does not serve, stays there untouched for its own worker; the same type on a queue the
// worker serves (IDEMQ_QUEUES, default `default`) is archived at once, with a reason, and
// a log line, that say what to do.
func TestWorkerOwnsItsQueues(t *testing.T) {
	t.Parallel()
	s := startStack(t, 1, nil, nil)
	refund := []byte(`{"order_id":"o-1"}`)
	s.enqueue(t, asynq.NewTask("billing:refund", refund), asynq.TaskID("refund-mine"), asynq.Queue("billing"), asynq.MaxRetry(25))
	s.enqueue(t, asynq.NewTask("billing:refund", refund), asynq.TaskID("refund-default"), asynq.MaxRetry(25))
	ok, _ := tasks.NewDebitTask(tasks.Debit{AccountID: "a", AmountCents: 5, Reference: "after-refunds"})
	s.enqueue(t, ok)
	s.waitCompleted(t, 1, 60*time.Second)

	var info *asynq.TaskInfo
	deadline := time.Now().Add(60 * time.Second)
	for {
		var err error
		if info, err = s.insp.GetTaskInfo(tasks.Queue, "refund-default"); err == nil && info.State == asynq.TaskStateArchived {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("billing:refund on %s: %+v, %v after 60s; want it archived", tasks.Queue, info, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, want := range []string{`unknown task type "billing:refund" on queue "default"`, "a queue of their own"} {
		if !strings.Contains(info.LastErr, want) || info.Retried != 0 {
			t.Errorf("billing:refund on %s: archived after %d retries with %q; want at once, with a reason containing %q",
				tasks.Queue, info.Retried, info.LastErr, want)
		}
	}
	mine, err := s.insp.GetTaskInfo("billing", "refund-mine")
	if err != nil || mine.State != asynq.TaskStatePending || mine.Retried != 0 || mine.LastErr != "" {
		t.Errorf("billing:refund on its own queue: %+v, %v; want it pending and untouched", mine, err)
	}
	// The worker says so: once at start (the queues it owns), and when it archives one.
	deadline = time.Now().Add(30 * time.Second)
	for {
		log := s.workers[0].tail(1 << 20)
		if strings.Contains(log, "a queue of their own") && strings.Contains(log, `task_type=billing:refund`) &&
			strings.Contains(log, "IDEMQ_QUEUES") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the worker's log names neither the archived type nor what to do:\n%s", log)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
