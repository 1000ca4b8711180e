package groupcommit_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency/groupcommit"
)

var errBad = errors.New("refused: bad request")

// A round the server refuses because of one request is sent again in halves: only that
// request fails, and every other commits.
func TestRefusedRoundSplitsDownToTheRequest(t *testing.T) {
	var mu sync.Mutex
	var committed []string
	release := make(chan struct{})
	c := groupcommit.New(groupcommit.Config[string]{
		Workers:  1,
		MaxBatch: 64,
		Timeout:  time.Second,
		Keys:     func(s string) []string { return []string{s} },
		Send: func(ctx context.Context, round []string) error {
			<-release
			if slices.Contains(round, "bad") {
				return errBad
			}
			mu.Lock()
			committed = append(committed, round...)
			mu.Unlock()
			return nil
		},
		Refused: func(err error) bool { return errors.Is(err, errBad) },
	})
	reqs := []string{"a", "b", "bad", "c", "d", "e"}
	errs := make([]error, len(reqs))
	var wg sync.WaitGroup
	for i, r := range reqs {
		wg.Go(func() { errs[i] = c.Run(context.Background(), r) })
	}
	time.Sleep(50 * time.Millisecond) // let them queue behind the first round
	close(release)
	wg.Wait()
	for i, r := range reqs {
		if want := r == "bad"; (errs[i] != nil) != want {
			t.Errorf("%s: err %v, want an error: %v", r, errs[i], want)
		}
	}
	slices.Sort(committed)
	if want := []string{"a", "b", "c", "d", "e"}; !slices.Equal(committed, want) {
		t.Errorf("committed %v, want %v", committed, want)
	}
}

// A round never carries a key twice: the second request with it waits for the next.
func TestRoundCarriesAKeyOnce(t *testing.T) {
	release := make(chan struct{})
	var mu sync.Mutex
	var rounds [][]string
	c := groupcommit.New(groupcommit.Config[string]{
		Workers:  1,
		MaxBatch: 64,
		Timeout:  time.Second,
		Keys:     func(s string) []string { return []string{s[:1]} },
		Send: func(ctx context.Context, round []string) error {
			<-release
			mu.Lock()
			rounds = append(rounds, slices.Clone(round))
			mu.Unlock()
			return nil
		},
	})
	var wg sync.WaitGroup
	for _, r := range []string{"x0", "x1", "y0"} {
		wg.Go(func() {
			if err := c.Run(context.Background(), r); err != nil {
				t.Error(err)
			}
		})
		time.Sleep(10 * time.Millisecond)
	}
	close(release)
	wg.Wait()
	for _, round := range rounds {
		seen := map[byte]bool{}
		for _, r := range round {
			if seen[r[0]] {
				t.Errorf("round %v carries key %c twice", round, r[0])
			}
			seen[r[0]] = true
		}
	}
	t.Logf("rounds: %v", rounds)
}
