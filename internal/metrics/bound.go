package metrics

import (
	"sync"
	"sync/atomic"
)

// bound keeps the children of a vector by their label values (one to three), so that a hot
// path finds a child with one lookup in a map that is never written, instead of
// WithLabelValues's validating and hashing under the vector's lock. Adding a child copies
// the map: label values come from small fixed sets (task types, events, outcomes), so
// that happens a few times in a process's life. The vector's children must never be
// deleted (nothing calls its Reset or Delete), or a kept child would count unseen. It is
// safe for concurrent use.
type bound[M any] struct {
	with func(values ...string) M // the vector's WithLabelValues
	mu   sync.Mutex               // serializes adding a child
	m    atomic.Pointer[map[[3]string]M]
}

func newBound[M any](with func(values ...string) M) *bound[M] {
	b := &bound[M]{with: with}
	b.m.Store(&map[[3]string]M{})
	return b
}

// get returns the child of a vector with two labels, values a and b.
func (b *bound[M]) get(a, c string) M {
	if child, ok := (*b.m.Load())[[3]string{a, c}]; ok {
		return child
	}
	return b.add([3]string{a, c}, 2)
}

// get1 returns the child of a vector with one label, value a.
func (b *bound[M]) get1(a string) M {
	if child, ok := (*b.m.Load())[[3]string{a}]; ok {
		return child
	}
	return b.add([3]string{a}, 1)
}

// get3 returns the child of a vector with three labels, values a, c and d.
func (b *bound[M]) get3(a, c, d string) M {
	if child, ok := (*b.m.Load())[[3]string{a, c, d}]; ok {
		return child
	}
	return b.add([3]string{a, c, d}, 3)
}

// add makes the child of the first n values of key, unless another call just did.
func (b *bound[M]) add(key [3]string, n int) M {
	b.mu.Lock()
	defer b.mu.Unlock()
	old := *b.m.Load()
	if child, ok := old[key]; ok {
		return child
	}
	child := b.with(key[:n]...)
	m := make(map[[3]string]M, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[key] = child
	b.m.Store(&m)
	return child
}
