package idempotency

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemq/idemq/idempotency/internal/store"
)

// HistoryKind names an exceptional event in a key's history (the kind column of
// processed_job_events). It is a type apart from Event, whose values count every
// outcome for metrics: a history keeps, per key, only what an operator asks about later.
type HistoryKind string

// The kinds of event a key's history records.
const (
	HistoryDuplicate      HistoryKind = "duplicate"       // a delivery of a completed key was answered from the ledger
	HistoryMismatch       HistoryKind = "mismatch"        // a delivery with another payload was refused
	HistoryBusy           HistoryKind = "busy"            // a delivery stayed busy past its budget and counted as a failure
	HistoryTakeover       HistoryKind = "takeover"        // a claim took the key over from an ended lease (Fence new, OldFence taken over)
	HistoryLeaseLost      HistoryKind = "lease_lost"      // a fenced write of a claim matched no row
	HistorySelfFence      HistoryKind = "self_fence"      // a handler was cancelled: no heartbeat reached the database in time
	HistoryNeedsAttention HistoryKind = "needs_attention" // the key was marked, or a delivery found it, needs_attention
	HistoryRerun          HistoryKind = "rerun"           // an operator re-ran the key (Rerun): a new generation
	HistoryRepublished    HistoryKind = "republished"     // the reconciler republished the key's task (TaskID key#r<n>)
)

// HistoryKinds are the kinds a history records, in the order a key's story usually meets
// them.
var HistoryKinds = []HistoryKind{HistoryDuplicate, HistoryMismatch, HistoryBusy, HistoryTakeover, HistoryLeaseLost,
	HistorySelfFence, HistoryNeedsAttention, HistoryRerun, HistoryRepublished}

// HistoryEvent is one event of a key's history. Times are the recording process's clock
// (At) when the event was seen; a rerun's and a republish's are the database's.
type HistoryEvent struct {
	Key        string
	Generation int
	At         time.Time
	Kind       HistoryKind
	TaskType   string
	TaskID     string // the asynq TaskID of the delivery, when known
	Worker     string // host/pid of the process that saw it
	Fence      int64  // the fence of the claim the event is about; 0: none
	OldFence   int64  // a takeover's: the fence taken over; 0: none
	Detail     string
}

// MaxHistory is how many of a key's newest events History returns.
const MaxHistory = 200

// History returns key's newest MaxHistory events (the last written) across generations,
// in the order they happened (their At, then the order they were written; At is the
// clock of the process that saw the event, so the order of events seen by processes
// whose clocks disagree follows their clocks): none when nothing was recorded. Recording is best-effort (see Record). Safe for
// concurrent use.
func (l *Ledger) History(ctx context.Context, key string) ([]HistoryEvent, error) {
	rows, err := store.KeyEvents(ctx, l.pool, key, MaxHistory)
	if err != nil {
		return nil, fmt.Errorf("idempotency: history of %s: %w", key, err)
	}
	out := make([]HistoryEvent, len(rows))
	for i, r := range rows {
		out[i] = HistoryEvent{Key: key, Generation: r.Generation, At: r.At, Kind: HistoryKind(r.Kind), TaskType: r.TaskType,
			TaskID: r.TaskID, Worker: r.Worker, Fence: r.Fence, OldFence: r.OldFence, Detail: r.Detail}
	}
	return out, nil
}

// Record adds e to its key's history, best-effort: it never waits for the database. The
// event joins a bounded buffer of this Ledger and is written with the next round of
// leased claims and finishes, or after the COMMIT of the next DoTx finish, that goes to
// Postgres anyway, or, when none goes within HistoryFlushDelay, by a background write. A full buffer drops the event; a
// crash drops what the buffer held; a failed write is logged at debug level. Each is
// counted (Config.ObserveHistory). Empty Worker and zero At are this process's and now.
// Safe for concurrent use.
func (l *Ledger) Record(e HistoryEvent) {
	l.hist.add(store.EventParams{Key: e.Key, Generation: e.Generation, At: e.At, Kind: string(e.Kind), TaskType: e.TaskType,
		TaskID: e.TaskID, Worker: e.Worker, Fence: e.Fence, OldFence: e.OldFence, Detail: e.Detail})
}

// Outcomes of history events passed to Config.ObserveHistory.
const (
	HistoryWritten = "written" // written with a round or by the background flush
	HistoryDropped = "dropped" // the buffer was full: the event was left out
	HistoryFailed  = "failed"  // its write failed: it is lost
)

// HistoryFlushDelay is how long a recorded event waits for a round to carry it before a
// background write of its own does.
const HistoryFlushDelay = time.Second

// historyBuffer is how many events wait at most for a write; past it new ones are dropped.
const historyBuffer = 1024

// history is a Ledger's buffer of events not written yet.
type history struct {
	l       *Ledger
	mu      sync.Mutex
	pending []store.EventParams
	armed   bool      // a flush is scheduled
	since   time.Time // when pending last became non-empty
	closed  bool
	// aloneUntil: until then rounds carry no events (see refused).
	aloneUntil time.Time
	// proven: an events statement was written (see TakeForCommit).
	proven atomic.Bool
	// max caps pending (historyBuffer); delay is HistoryFlushDelay. Tests change them.
	max   int
	delay time.Duration
}

func (h *history) add(e store.EventParams) {
	if e.At.IsZero() {
		e.At = time.Now()
	}
	if e.Worker == "" {
		e.Worker = store.Worker
	}
	h.mu.Lock()
	if len(h.pending) >= h.max || h.closed {
		h.mu.Unlock()
		h.l.observeHistory(HistoryDropped, 1)
		return
	}
	if len(h.pending) == 0 {
		h.since = time.Now()
	}
	h.pending = append(h.pending, e)
	arm := !h.armed
	h.armed = true
	h.mu.Unlock()
	if arm {
		time.AfterFunc(h.delay, h.flush)
	}
}

// take hands over every pending event, for a round about to be sent; nil when there is
// none, or while rounds may not carry them (see refused). The caller reports how the
// write went with done (or refused).
func (h *history) take() []store.EventParams { return h.takeFor(true) }

// takeFor is take for a round (round) or for the background flush, which takes every
// pending event.
func (h *history) takeFor(round bool) []store.EventParams {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.pending) == 0 || round && time.Now().Before(h.aloneUntil) {
		return nil
	}
	es := h.pending
	h.pending = nil
	return es
}

// parts is a round's parts with es's statement first (parts itself without events).
func (h *history) parts(es []store.EventParams, parts []store.Part) []store.Part {
	if len(es) == 0 {
		return parts
	}
	return append([]store.Part{store.EventsPart(es)}, parts...)
}

// refused takes back es, whose statement the server refused in a round (which is sent
// again without them): for historyAlone only the background flush writes events, so that
// a statement the server refuses (a table not migrated yet) costs a round at most that
// often.
func (h *history) refused(es []store.EventParams, err error) {
	h.l.log.Debug("idempotency: a round with history events was refused; sent again without them", "events", len(es), "err", err)
	h.giveBack(es, true)
}

// giveBack puts es back in front of the pending events (as many as there is room for),
// for the next round, or (alone) for the background flush only, for historyAlone.
func (h *history) giveBack(es []store.EventParams, alone bool) {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		h.l.observeHistory(HistoryFailed, len(es))
		return
	}
	if len(h.pending) == 0 {
		h.since = time.Now()
	}
	if alone {
		h.aloneUntil = time.Now().Add(historyAlone)
	}
	room := max(h.max-len(h.pending), 0)
	dropped := max(len(es)-room, 0)
	h.pending = append(es[:len(es)-dropped:len(es)-dropped], h.pending...)
	arm := !h.armed
	h.armed = true
	h.mu.Unlock()
	if dropped > 0 {
		h.l.observeHistory(HistoryDropped, dropped)
	}
	if arm {
		time.AfterFunc(h.delay, h.flush)
	}
}

// historyAlone is how long rounds carry no events after one was refused with them.
const historyAlone = time.Minute

// done counts es, written (err nil) or lost.
func (h *history) done(es []store.EventParams, err error) {
	if len(es) == 0 {
		return
	}
	if err != nil {
		h.l.log.Debug("idempotency: history events not written", "events", len(es), "err", err)
		h.l.observeHistory(HistoryFailed, len(es))
		return
	}
	h.proven.Store(true)
	h.l.observeHistory(HistoryWritten, len(es))
}

// TakeForCommit takes the events a DoTx finish carries after its COMMIT: only once an
// events statement has been written in this process (the finish's batch prepares its
// statements before it sends them, so an events statement the server could not prepare
// would refuse the whole finish).
func (h *history) TakeForCommit() []store.EventParams {
	if !h.proven.Load() {
		return nil
	}
	return h.take()
}

// Done reports a DoTx finish that carried es: when its COMMIT did not happen (commitErr),
// neither did their statement, and they wait for the next round; else eventsErr is
// theirs. Events the server refused (processed_job_events locked past
// store.EventsLockTimeout, say) are counted lost, and for historyAlone finishes carry
// none, so that no other finish waits for that lock even briefly.
func (h *history) Done(es []store.EventParams, commitErr, eventsErr error) {
	if commitErr != nil {
		h.giveBack(es, false)
		return
	}
	if eventsErr != nil && store.Answered(eventsErr) {
		h.mu.Lock()
		h.aloneUntil = time.Now().Add(historyAlone)
		h.mu.Unlock()
	}
	h.done(es, eventsErr)
}

// flush writes what no round carried within HistoryFlushDelay, in a statement of its own:
// events that have waited less (a round took the older ones) wait on, so that a busy
// process, whose rounds carry its events, writes none by itself.
func (h *history) flush() {
	h.mu.Lock()
	if waited := time.Since(h.since); len(h.pending) > 0 && waited < h.delay {
		h.mu.Unlock()
		time.AfterFunc(h.delay-waited, h.flush)
		return
	}
	h.armed = false
	h.mu.Unlock()
	h.write()
}

func (h *history) write() {
	es := h.takeFor(false)
	if len(es) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), h.l.cfg.WriteTimeout)
	defer cancel()
	h.done(es, store.WriteEvents(ctx, h.l.pool, es))
}

// close writes what is pending and refuses later events.
func (h *history) close() {
	h.mu.Lock()
	h.closed = true
	h.mu.Unlock()
	h.write()
}

func (l *Ledger) observeHistory(outcome string, n int) {
	if l.cfg.ObserveHistory != nil {
		l.cfg.ObserveHistory(outcome, n)
	}
}

// recordClaim records kind for c's key.
func (l *Ledger) recordClaim(kind HistoryKind, c *Claim, detail string) {
	e := HistoryEvent{Key: c.Key, Generation: c.Generation, Kind: kind, TaskType: c.TaskType, TaskID: c.taskID, Fence: c.Fence, Detail: detail}
	if kind == HistoryTakeover {
		e.OldFence = c.prevFence
	}
	l.Record(e)
}
