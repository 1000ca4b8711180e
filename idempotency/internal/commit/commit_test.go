package commit

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

func self(s string) string { return s }

// A batch takes each key once, none a batch in flight holds, in key order; a worker
// that finds nothing stops counting.
func TestQueueTakesKeysOnceInOrder(t *testing.T) {
	q := NewQueue(2, 1, self)
	if !q.Push(0, "c") || q.Push(0, "a") || q.Push(0, "c") || q.Push(1, "b") {
		t.Fatal("only the first push may start the one worker")
	}
	b := q.Take(10)
	if !slices.Equal(b[0], []string{"a", "c"}) || !slices.Equal(b[1], []string{"b"}) {
		t.Fatalf("first batch %v, want [[a c] [b]]", b)
	}
	if q.Len() != 1 || q.Ready() {
		t.Fatalf("the second c waits (%d queued) and is not ready while the first is in flight", q.Len())
	}
	q.Done(b)
	if !q.Ready() {
		t.Fatal("c is ready once the first batch is done")
	}
	if b2 := q.Take(10); !slices.Equal(b2[0], []string{"c"}) {
		t.Fatalf("second batch %v, want [[c] []]", b2)
	}
	if q.Take(10) != nil {
		t.Fatal("an empty queue hands out a batch")
	}
	if !q.Push(1, "d") {
		t.Fatal("after the worker stopped, a push must start one")
	}
	if !q.Leave(1, "d") || q.Leave(1, "d") {
		t.Fatal("a waiting request leaves once")
	}
}

// A spare worker starts only when more requests wait than depth per running worker.
func TestQueueSpareWorkerStartsWhenDeep(t *testing.T) {
	q := NewQueueSpare(1, 1, 1, self)
	if !q.PushDeep(0, "a", 2) {
		t.Fatal("the first push must start the first worker")
	}
	if q.PushDeep(0, "b", 2) {
		t.Fatal("two waiting, depth 2: the running worker's next batch takes them; no spare")
	}
	if !q.PushDeep(0, "c", 2) {
		t.Fatal("three waiting, depth 2: the spare must start")
	}
	if q.PushDeep(0, "d", 1) || q.Push(0, "e") {
		t.Fatal("both workers run: nothing more may start")
	}
	for range 2 {
		if b := q.Take(2); b == nil || len(b[0]) != 2 {
			t.Fatalf("each worker takes a batch of two, got %v", b)
		}
	}
}

// A refused round is sent again lane by lane, and a lane in halves, down to the request
// at fault; the others commit.
func TestCommitterIsolatesTheRefusedRequest(t *testing.T) {
	refused := errors.New("refused")
	var mu sync.Mutex
	var committed []string
	c := New(Config[string]{
		Lanes: 2, Workers: 1, MaxBatch: 64, Timeout: time.Second, Key: self,
		Send: func(_ context.Context, batches [][]string) error {
			for _, b := range batches {
				if slices.Contains(b, "bad") {
					return refused
				}
			}
			mu.Lock()
			defer mu.Unlock()
			for _, b := range batches {
				committed = append(committed, b...)
			}
			return nil
		},
		Refused:   func(err error) bool { return errors.Is(err, refused) },
		Retryable: func(error) bool { return false },
	})
	errs := c.Round([][]string{{"a", "b"}, {"bad", "c", "d", "e"}})
	for lane, es := range errs {
		for i, err := range es {
			if want := lane == 1 && i == 0; (err != nil) != want {
				t.Errorf("lane %d request %d: %v", lane, i, err)
			}
		}
	}
	slices.Sort(committed)
	if !slices.Equal(committed, []string{"a", "b", "c", "d", "e"}) {
		t.Errorf("committed %v", committed)
	}
}

// Inline sends each request alone on its caller's goroutine; a caller whose ctx ends
// while it waits leaves with ctx's cause.
func TestCommitterInlineAndLeaving(t *testing.T) {
	var sizes []int
	inline := New(Config[string]{Lanes: 1, Workers: 1, MaxBatch: 64, Inline: true, Timeout: time.Second, Key: self,
		Send:    func(_ context.Context, b [][]string) error { sizes = append(sizes, len(b[0])); return nil },
		Refused: func(error) bool { return false }, Retryable: func(error) bool { return false }})
	for _, k := range []string{"a", "b"} {
		if err := inline.Run(context.Background(), 0, k); err != nil {
			t.Fatal(err)
		}
	}
	if !slices.Equal(sizes, []int{1, 1}) {
		t.Errorf("inline batch sizes %v, want [1 1]", sizes)
	}

	release := make(chan struct{})
	sending := make(chan struct{}, 1)
	blocked := New(Config[string]{Lanes: 1, Workers: 1, MaxBatch: 64, Timeout: time.Minute, Key: self,
		Send: func(context.Context, [][]string) error {
			select {
			case sending <- struct{}{}:
			default:
			}
			<-release
			return nil
		},
		Refused: func(error) bool { return false }, Retryable: func(error) bool { return false }})
	first := make(chan error, 1)
	go func() { first <- blocked.Run(context.Background(), 0, "k") }()
	<-sending // the first request is in flight
	cause := errors.New("caller gone")
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(cause)
	if err := blocked.Run(ctx, 0, "k"); !errors.Is(err, cause) {
		t.Errorf("queued behind its own key and cancelled: %v, want the cause", err)
	}
	close(release)
	if err := <-first; err != nil {
		t.Errorf("the round in flight: %v", err)
	}
}

// A request with several keys joins a batch only when none of them is in the batch or in
// flight: two requests sharing their second key never meet in one batch.
func TestQueueKeysKeepSharedKeysApart(t *testing.T) {
	keys := func(s string) []string { return strings.Split(s, "/") }
	q := NewQueueKeys(1, 1, 0, keys, false)
	for _, s := range []string{"j2/h1", "j1/h1", "j3", "j4/h2"} {
		q.Push(0, s)
	}
	b := q.Take(10)
	if !slices.Equal(b[0], []string{"j2/h1", "j3", "j4/h2"}) {
		t.Fatalf("first batch %v, want [j2/h1 j3 j4/h2]: j1/h1 shares h1 with j2/h1", b[0])
	}
	if q.Ready() {
		t.Fatal("j1/h1 is ready while h1 is in flight")
	}
	q.Done(b)
	if b2 := q.Take(10); !slices.Equal(b2[0], []string{"j1/h1"}) {
		t.Fatalf("second batch %v, want [j1/h1]", b2[0])
	}
}

// With roundOnly, a key in flight does not hold a request back: only a batch keeps its
// keys apart.
func TestQueueRoundOnlyLetsBatchesShareKeys(t *testing.T) {
	q := NewQueueKeys(1, 2, 0, func(s string) []string { return strings.Split(s, "/") }, true)
	q.Push(0, "j1/h1")
	q.Push(0, "j2/h1")
	b := q.Take(10)
	if !slices.Equal(b[0], []string{"j1/h1"}) {
		t.Fatalf("first batch %v, want [j1/h1]", b[0])
	}
	if b2 := q.Take(10); b2 == nil || !slices.Equal(b2[0], []string{"j2/h1"}) {
		t.Fatalf("second batch %v, want [j2/h1] while the first is in flight", b2)
	}
	q.Done(b)
}
