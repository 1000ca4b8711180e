package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
)

// The error handler counts deliveries past the busy budget by reason, and nothing else.
func TestErrorHandlerCountsOverBudget(t *testing.T) {
	var got []string
	s := &Server{log: slog.New(slog.DiscardHandler), cfg: Config{ObserveOverBudget: func(taskType, reason string) {
		got = append(got, taskType+"/"+reason)
	}}}
	task := asynq.NewTask("t", nil)
	for _, err := range []error{
		fmt.Errorf("wrapped: %w", &asynqmw.BusyTooLongError{Key: "k", Age: time.Hour}),
		&asynqmw.UnavailableTooLongError{Key: "k", Age: time.Hour, Err: errors.New("down")},
		idempotency.ErrBusy,
		errors.New("handler failed"),
	} {
		s.logError(context.Background(), task, err)
	}
	if want := "[t/busy t/unavailable]"; fmt.Sprint(got) != want {
		t.Errorf("observed %v, want %s", got, want)
	}
}
