// Package commit is the engine that lets concurrent requests share commits: a
// key-ordered queue that hands out batches with at most one request per key in flight,
// and a committer that sends a batch as one transaction, splitting it when the server
// refuses it. It knows nothing of SQL: its users say how a batch is sent. It also makes
// the span of work that several traced callers share, a root linked both ways with each
// member's span (span.go).
package commit

import (
	"cmp"
	"slices"
	"sync"
)

// Queue holds the requests waiting for a batch, in lanes (kinds of request that one
// batch carries side by side, such as claims and completions), and counts the workers
// that take batches from it. A batch takes each key at most once per lane, and no key a
// batch in flight holds, in key order, so that concurrent batches lock rows in one order.
// It is safe for concurrent use.
type Queue[T comparable] struct {
	keys func(T) []string // the first orders a batch
	// roundOnly: a key is unique within a batch only; batches in flight may share it.
	roundOnly bool
	workers   int
	spare     int // workers beyond these start only when the queue is deep (PushDeep)

	mu       sync.Mutex
	lanes    [][]T
	inFlight []map[string]bool
	running  int
}

// NewQueue returns a queue of lanes lanes, served by at most workers workers, whose
// requests have the keys key gives.
func NewQueue[T comparable](lanes, workers int, key func(T) string) *Queue[T] {
	return NewQueueSpare(lanes, workers, 0, key)
}

// NewQueueSpare is NewQueue with spare more workers, which start only when the queue is
// deep (PushDeep).
func NewQueueSpare[T comparable](lanes, workers, spare int, key func(T) string) *Queue[T] {
	return NewQueueKeys(lanes, workers, spare, func(t T) []string { return []string{key(t)} }, false)
}

// NewQueueKeys is NewQueueSpare for requests with several keys (an API request's header
// key and its job's key, say): a batch takes a request only when none of its keys is in
// the batch or, unless roundOnly, in a batch in flight; it orders its batch by the first
// key. With roundOnly, two batches in flight may hold one key: the second waits for the
// first's row locks in the server, as two separate transactions would.
func NewQueueKeys[T comparable](lanes, workers, spare int, keys func(T) []string, roundOnly bool) *Queue[T] {
	q := &Queue[T]{keys: keys, roundOnly: roundOnly, workers: max(workers, 1), spare: max(spare, 0), lanes: make([][]T, lanes), inFlight: make([]map[string]bool, lanes)}
	for i := range q.inFlight {
		q.inFlight[i] = make(map[string]bool)
	}
	return q
}

// Push queues t in lane. It reports whether the caller must start a worker (fewer than
// the maximum run, spare ones included); that worker calls Take until it returns nil.
func (q *Queue[T]) Push(lane int, t T) (startWorker bool) { return q.PushDeep(lane, t, 0) }

// PushDeep is Push that also starts a spare worker, when more than depth requests per
// running worker wait in lane: more than the running workers' next batches take, so that
// another worker would not just split them.
func (q *Queue[T]) PushDeep(lane int, t T, depth int) (startWorker bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.lanes[lane] = append(q.lanes[lane], t)
	if q.running < q.workers || q.running < q.workers+q.spare && len(q.lanes[lane]) > depth*q.running {
		q.running++
		return true
	}
	return false
}

// Leave takes t out of lane, unless a batch took it already (then it reports false and
// t's batch answers it).
func (q *Queue[T]) Leave(lane int, t T) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	i := slices.Index(q.lanes[lane], t)
	if i < 0 {
		return false
	}
	q.lanes[lane] = slices.Delete(q.lanes[lane], i, i+1)
	return true
}

// Ready reports whether Take would find anything now.
func (q *Queue[T]) Ready() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	for i, lane := range q.lanes {
		for _, t := range lane {
			if !q.held(i, t) {
				return true
			}
		}
	}
	return false
}

// Len is how many requests wait, in every lane.
func (q *Queue[T]) Len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	n := 0
	for _, lane := range q.lanes {
		n += len(lane)
	}
	return n
}

// Take removes up to n waiting requests of each lane whose keys no batch in flight
// holds, each lane's sorted by key, and marks their keys in flight until Done. When it
// finds nothing it returns nil and the worker calling it must end: it no longer counts.
func (q *Queue[T]) Take(n int) [][]T {
	q.mu.Lock()
	defer q.mu.Unlock()
	batches := make([][]T, len(q.lanes))
	found := false
	for i, lane := range q.lanes {
		rest := lane[:0]
		for _, t := range lane {
			if len(batches[i]) < n && !q.held(i, t) {
				for _, k := range q.keys(t) {
					q.inFlight[i][k] = true
				}
				batches[i] = append(batches[i], t)
			} else {
				rest = append(rest, t)
			}
		}
		clear(lane[len(rest):])
		q.lanes[i] = rest
		if q.roundOnly {
			clear(q.inFlight[i])
		}
		if len(batches[i]) > 0 {
			found = true
			slices.SortFunc(batches[i], func(a, b T) int { return cmp.Compare(q.keys(a)[0], q.keys(b)[0]) })
		}
	}
	if !found {
		q.running--
		return nil
	}
	return batches
}

// Done frees the keys of batches, which Take returned.
func (q *Queue[T]) Done(batches [][]T) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.roundOnly {
		return
	}
	for i, b := range batches {
		for _, t := range b {
			for _, k := range q.keys(t) {
				delete(q.inFlight[i], k)
			}
		}
	}
}

// held reports whether one of t's keys is in lane's batches in flight (or in the batch
// being taken).
func (q *Queue[T]) held(lane int, t T) bool {
	for _, k := range q.keys(t) {
		if q.inFlight[lane][k] {
			return true
		}
	}
	return false
}
