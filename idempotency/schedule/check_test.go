package schedule_test

import (
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency/schedule"
)

// settleCheck is a handler's check of a payload: a period it can settle.
func settleCheck(payload []byte) error {
	var p struct {
		Period string `json:"period"`
	}
	if err := json.Unmarshal(payload, &p); err != nil {
		return err
	}
	if d, err := time.ParseDuration(p.Period); err != nil || d <= 0 {
		return errors.New("period: must be a positive Go duration")
	}
	return nil
}

// TestNewRefusesWhatEveryTickWouldRefuse: with Config.TaskTypes, an entry of a task type
// the scheduler does not know, or whose job its task refuses, is refused by New, naming
// the entry and the field; the others pass.
func TestNewRefusesWhatEveryTickWouldRefuse(t *testing.T) {
	t.Parallel()
	cfg := &schedule.Config{TaskTypes: map[string]func([]byte) error{"wallet:settle": settleCheck, "ping": nil}}
	for _, c := range []struct {
		e     schedule.Entry
		field string
	}{
		{schedule.Entry{Name: "typo", Schedule: "@hourly", TaskType: "wallet:setle", Payload: []byte(`{"period":"1h"}`)}, "task_type"},
		{schedule.Entry{Name: "bad-period", Schedule: "@hourly", TaskType: "wallet:settle", Payload: []byte(`{"period":"soon"}`)}, "payload"},
	} {
		_, err := schedule.New(nil, nil, []schedule.Entry{c.e}, cfg)
		var ee *schedule.EntryError
		if !errors.As(err, &ee) || ee.Field != c.field || ee.Entry != `"`+c.e.Name+`"` {
			t.Errorf("%s: %v, want an *EntryError on entry %q, field %s", c.e.Name, err, c.e.Name, c.field)
		}
	}
	_, err := schedule.New(nil, nil, []schedule.Entry{
		{Name: "ok", Schedule: "@hourly", TaskType: "wallet:settle", Payload: []byte(`{"period":"1h"}`)},
		{Name: "ping", Schedule: "@every 1m", TaskType: "ping"},
	}, cfg)
	if err != nil {
		t.Errorf("valid entries: %v", err)
	}
}

// TestRoundSkipsATableEntryItsTaskTypesRefuse: an entry another replica wrote to the
// table, of a task type this replica does not enqueue, is not enqueued by it.
func TestRoundSkipsATableEntryItsTaskTypesRefuse(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	f.replica([]schedule.Entry{{Name: "typo", Schedule: "@every 1m", TaskType: "wallet:setle"}}, 0)
	s, err := schedule.New(f.pool, f.client, nil, &schedule.Config{Logger: quiet, Now: f.dbNow, DatabaseNow: f.dbNow,
		TaskTypes: map[string]func([]byte) error{"wallet:settle": nil}})
	if err != nil {
		t.Fatal(err)
	}
	f.tick(s)
	f.clock.now = f.clock.now.Add(3 * time.Minute)
	if st := f.tick(s); st.Enqueued != 0 || len(f.jobs("typo")) != 0 {
		t.Errorf("an entry of an unknown task type: %+v, jobs %v; want none", st, f.jobs("typo"))
	}
}
