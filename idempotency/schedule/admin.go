package schedule

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/idempotency/outbox"
)

// ErrNoEntry means the schedule table has no entry of that name.
var ErrNoEntry = errors.New("schedule: no such entry")

// Status is an entry as the schedule table holds it, for operators (List).
type Status struct {
	Entry
	Revision  int64
	Paused    bool
	RevisedAt time.Time
	// LastTick is the newest tick any replica enqueued (zero: none yet), LastKey its job's
	// key and LastState its outbox intent's state ("" when the intent is gone).
	LastTick  time.Time
	LastKey   string
	LastState string
	// Next is the entry's first tick after the time List was given (zero: none).
	Next time.Time
	// Err is set when the entry cannot be read by this build (another replica's newer
	// revision, say); the other fields but the name may then be empty.
	Err error
}

// List returns every entry of the schedule table with its last and next tick, by name.
// Safe for concurrent use.
func List(ctx context.Context, pool *pgxpool.Pool, now time.Time) ([]Status, error) {
	rows, err := store.ReadSchedule(ctx, pool)
	if err != nil {
		return nil, fmt.Errorf("schedule: read the schedule table: %w", err)
	}
	out := make([]Status, 0, len(rows))
	for _, r := range rows {
		st := Status{Entry: Entry{Name: r.Name}, Revision: r.Revision, Paused: r.Paused, RevisedAt: r.RevisedAt,
			LastTick: r.LastTick.Time, LastKey: r.LastKey.String, LastState: r.LastState.String}
		p, err := readPlan(r)
		if err != nil {
			st.Err = err
		} else {
			st.Entry = p.Entry
			if n := p.sched.Next(now); !n.IsZero() {
				st.Next = n.UTC()
			}
		}
		out = append(out, st)
	}
	return out, nil
}

func readPlan(r store.ScheduleEntryRow) (*plan, error) {
	var e Entry
	if err := json.Unmarshal(r.Spec, &e); err != nil {
		return nil, fmt.Errorf("schedule: entry %q revision %d: %w", r.Name, r.Revision, err)
	}
	p, err := compile(e, fmt.Sprintf("%q", r.Name))
	if err != nil {
		return nil, fmt.Errorf("revision %d: %w", r.Revision, err)
	}
	return p, nil
}

// Pause stops entry name's ticks on every replica from their next round until Resume:
// the ticks that fall meanwhile are skipped, not caught up. ErrNoEntry when there is no
// such entry.
func Pause(ctx context.Context, pool *pgxpool.Pool, name string) error {
	return setPaused(ctx, pool, name, true)
}

// Resume undoes Pause: the entry ticks again from the replicas' next round.
func Resume(ctx context.Context, pool *pgxpool.Pool, name string) error {
	return setPaused(ctx, pool, name, false)
}

func setPaused(ctx context.Context, pool *pgxpool.Pool, name string, paused bool) error {
	ok, err := store.PauseSchedule(ctx, pool, name, paused)
	switch {
	case err != nil:
		return fmt.Errorf("schedule: pause %q: %w", name, err)
	case !ok:
		return fmt.Errorf("%w: %q", ErrNoEntry, name)
	}
	return nil
}

// RunNow enqueues one job of entry name at, outside its schedule, keyed ManualKey(name,
// id): the same id is the same run (a duplicate), whoever asks and whenever. Its Tick is
// At: at (to the second) of the first ask, Manual: id; a later ask of the same id, whose
// at differs, answers the first's intent as a duplicate. id is 1..64 bytes of what a key
// may hold. ErrNoEntry when there is no such entry; the outbox's errors otherwise.
func RunNow(ctx context.Context, pool *pgxpool.Pool, client *outbox.Client, name, id string, at time.Time) (outbox.EnqueueResult, error) {
	if len(id) == 0 || len(id) > MaxManualID {
		return outbox.EnqueueResult{}, fmt.Errorf("%w: manual run id: %d bytes, must be 1..%d", idempotency.ErrInvalidKey, len(id), MaxManualID)
	}
	rows, err := store.ReadSchedule(ctx, pool)
	if err != nil {
		return outbox.EnqueueResult{}, fmt.Errorf("schedule: read the schedule table: %w", err)
	}
	for _, r := range rows {
		if r.Name != name {
			continue
		}
		p, err := readPlan(r)
		if err != nil {
			return outbox.EnqueueResult{}, err
		}
		key := ManualKey(name, id)
		if res, ok := manualRunRecorded(ctx, pool, key); ok {
			return res, nil
		}
		res, err := client.Enqueue(ctx, p.spec(Tick{Entry: name, At: at.UTC().Truncate(time.Second), Manual: id}))
		if errors.Is(err, idempotency.ErrMismatch) {
			// Another ask of the same id, at another second, recorded it meanwhile.
			if res, ok := manualRunRecorded(ctx, pool, key); ok {
				return res, nil
			}
		}
		return res, err
	}
	return outbox.EnqueueResult{}, fmt.Errorf("%w: %q", ErrNoEntry, name)
}

// manualRunRecorded answers a manual run whose key has an intent already: a duplicate.
func manualRunRecorded(ctx context.Context, pool *pgxpool.Pool, key string) (outbox.EnqueueResult, bool) {
	in, err := outbox.ReadIntent(ctx, pool, key)
	if err != nil {
		return outbox.EnqueueResult{}, false
	}
	return outbox.EnqueueResult{Key: key, Duplicate: true, State: in.State}, true
}
