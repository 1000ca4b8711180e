package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/tasks"
)

// pacer hands out a steady load's send slots: slot i is due at start + i/rate, whichever
// goroutine takes it. A producer that falls behind finds its slots overdue and sends them
// at once, so the load stays open: the rate asked, not the rate the system answers.
// Safe for concurrent use.
type pacer struct {
	start time.Time
	rate  float64 // slots per second
	next  atomic.Int64
}

// take returns the next slot and when it is due.
func (p *pacer) take() (int64, time.Time) {
	i := p.next.Add(1) - 1
	return i, p.due(i)
}

// due is when slot i is due.
func (p *pacer) due(i int64) time.Time {
	return p.start.Add(time.Duration(float64(i) / p.rate * float64(time.Second)))
}

// before is how many slots are due before start + d.
func (p *pacer) before(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64(math.Ceil(d.Seconds()*p.rate - 1e-9))
}

// soakProducer enqueues a soak's debits with a plain asynq client (no TaskID, no idemq
// header): a new key per slot, or, for a share dup of the slots, the payload of a key
// enqueued in the last 10 seconds again.
type soakProducer struct {
	client    *asynq.Client
	w         drainWorkload
	prefix    string
	rate, dup float64
	maxRetry  int
	producers int
	pace      *pacer

	sent, dups, failed atomic.Int64
	mu                 sync.Mutex
	firstErr           string
	recent             [][]byte // a ring of the last new keys' payloads
	recentNext         int
}

func newSoakProducer(rdb *redis.Client, w drainWorkload, prefix string, rate, dup float64, maxRetry, producers int) *soakProducer {
	return &soakProducer{client: asynq.NewClientFromRedisClient(rdb), w: w, prefix: prefix, rate: rate, dup: dup, maxRetry: maxRetry,
		producers: producers, recent: make([][]byte, 0, max(1, int(rate*10)))}
}

// start runs the producer's goroutines from start until ctx ends; the channel closes
// once they have returned.
func (p *soakProducer) start(ctx context.Context, start time.Time) <-chan struct{} {
	p.pace = &pacer{start: start, rate: p.rate}
	done := make(chan struct{})
	var wg sync.WaitGroup
	for g := range p.producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.run(ctx, rand.New(rand.NewPCG(uint64(start.UnixNano()), uint64(g))))
		}()
	}
	go func() {
		wg.Wait()
		close(done)
	}()
	return done
}

func (p *soakProducer) run(ctx context.Context, rng *rand.Rand) {
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		i, due := p.pace.take()
		if d := time.Until(due); d > 0 {
			timer.Reset(d)
			select {
			case <-ctx.Done():
				return
			case <-timer.C:
			}
		}
		if ctx.Err() != nil {
			return
		}
		var payload []byte
		if rng.Float64() < p.dup {
			payload = p.again(rng)
		}
		dup := payload != nil
		if !dup {
			payload = p.debit(rng, i, time.Now())
		}
		_, err := p.client.EnqueueContext(ctx, asynq.NewTask(p.w.typ, payload), asynq.Queue(tasks.Queue), asynq.MaxRetry(p.maxRetry))
		switch {
		case err != nil && ctx.Err() != nil:
			return
		case err != nil:
			if p.failed.Add(1) == 1 {
				p.mu.Lock()
				p.firstErr = err.Error()
				p.mu.Unlock()
			}
		case dup:
			p.sent.Add(1)
			p.dups.Add(1)
		default:
			p.sent.Add(1)
			p.remember(payload)
		}
	}
}

// debit is slot i's new debit, enqueued at at: its reference carries the time, in
// microseconds since the epoch, after the key's prefix and number.
func (p *soakProducer) debit(rng *rand.Rand, i int64, at time.Time) []byte {
	s := strconv.Itoa(p.w.scope(rng, int(i)))
	b, _ := json.Marshal(tasks.Debit{AccountID: "acct-" + s, AmountCents: 1,
		Reference: fmt.Sprintf("%s-%d-%d", p.prefix, i, at.UnixMicro())})
	return b
}

func (p *soakProducer) remember(payload []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.recent) < cap(p.recent) {
		p.recent = append(p.recent, payload)
		return
	}
	p.recent[p.recentNext] = payload
	p.recentNext = (p.recentNext + 1) % len(p.recent)
}

// again returns a recent key's payload, nil before the first.
func (p *soakProducer) again(rng *rand.Rand) []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.recent) == 0 {
		return nil
	}
	return p.recent[rng.IntN(len(p.recent))]
}

// counts returns the enqueues so far and the duplicates among them.
func (p *soakProducer) counts() (sent, dups int64) { return p.sent.Load(), p.dups.Load() }

func (p *soakProducer) errors() (int64, string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.failed.Load(), p.firstErr
}

// lockCounts accumulates sampleLocks' findings until a minute's sample takes them.
type lockCounts struct {
	mu                           sync.Mutex
	samples, hot, onPurge, purge int
}

// take returns the counts since the last take and starts again from zero.
func (l *lockCounts) take() (samples, hot, onPurge, purge int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	samples, hot, onPurge, purge = l.samples, l.hot, l.onPurge, l.purge
	l.samples, l.hot, l.onPurge, l.purge = 0, 0, 0, 0
	return
}

// sampleLocks reads every interval until ctx ends which backends of the database wait
// for a lock: hot-path ones (any statement but the purge's), those among them that a
// purge statement blocks, and purge statements waiting.
func (e *env) sampleLocks(ctx context.Context, every time.Duration, into *lockCounts) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		var hot, onPurge, purge int
		if err := e.admin.QueryRow(ctx, soakLockWaitsSQL, purgeStatementRE).Scan(&hot, &onPurge, &purge); err != nil {
			continue // counted as no sample
		}
		into.mu.Lock()
		into.samples++
		into.hot, into.onPurge, into.purge = into.hot+hot, into.onPurge+onPurge, into.purge+purge
		into.mu.Unlock()
	}
}
