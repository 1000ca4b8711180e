package tasks

import (
	_ "embed"
	"errors"
	"fmt"
	"time"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/schedule"
)

// TypeSettle is the example's periodic task: settle the wallet entries of a period.
const TypeSettle = "wallet:settle"

// MaxSettlePeriod is the longest period a settlement sums.
const MaxSettlePeriod = 31 * 24 * time.Hour

var _ idempotency.Job = Settle{}

// Settle is the payload of wallet:settle, a periodic job: the scheduler's fields (its
// entry and tick, schedule.Tick, which also give its key cron:<entry>:<tick> and its lock
// scope, the key) and the entry's period, a Go duration: the settlement sums the wallet
// entries created in (tick - period, tick], and those created earlier whose transactions
// committed after the settlement of their own period (handlers.Settle).
type Settle struct {
	schedule.Tick
	Period string `json:"period"`
}

// Span returns the settled period, (start, end].
func (s Settle) Span() (start, end time.Time) {
	d, _ := time.ParseDuration(s.Period)
	return s.At.Add(-d), s.At
}

// Validate reports the first invalid field, by its JSON name.
func (s Settle) Validate() error {
	if err := idempotency.ValidateKey(s.Key()); err != nil {
		return fmt.Errorf("schedule_entry: %w", err)
	}
	if s.At.IsZero() {
		return errors.New("tick: required")
	}
	d, err := time.ParseDuration(s.Period)
	if err != nil || d <= 0 || d > MaxSettlePeriod {
		return fmt.Errorf("period: %q must be a Go duration in (0, %v]", s.Period, MaxSettlePeriod)
	}
	return nil
}

// DecodeSettle strictly decodes and validates a wallet:settle payload.
func DecodeSettle(payload []byte) (Settle, error) {
	s, err := decodeStrict[Settle](payload)
	if err != nil {
		return Settle{}, err
	}
	return s, s.Validate()
}

// ExampleSchedule is the example's schedule file (tasks/schedule.yaml): a settlement
// every minute of the minute before.
//
//go:embed schedule.yaml
var ExampleSchedule []byte
