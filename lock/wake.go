package lock

import (
	"context"
	"crypto/rand"
	_ "embed"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Wake-ups between processes. Each Batcher is a node with a channel of its own in Redis
// pub/sub, and the tokens of the locks it obtains name it (<node>.<random>). When
// Obtain with Options.Want finds a key held by another node's lock, it tells that node,
// which Batcher.Wanted then reports to the holder: it can end its turn early. When the
// holder lets the lock go, Batcher.Wake tells the nodes that waited, and their callers
// waiting on Batcher.Freed try again at once instead of at their next poll.
//
// A message can be lost (a reconnect, a want that crossed the release): callers keep
// polling, more slowly, and a holder that heard nothing keeps its own bounds.

var (
	//go:embed wake.lua
	wakeLua    string
	wakeScript = redis.NewScript(wakeLua)
)

// wantFresh is how long a want is heard after its last message: a caller still waiting
// repeats it at every try (a few tens of milliseconds apart).
const wantFresh = 250 * time.Millisecond

// node is a Batcher's side of the wake-ups.
type node struct {
	id      string
	channel string
	start   sync.Once
	ps      *redis.PubSub // nil until listen, or when the client cannot subscribe

	mu     sync.Mutex
	wants  map[string]map[string]time.Time // lock key → channel of a waiting node → last heard
	pruned time.Time                       // when wants was last rid of what is no longer heard
	waits  map[string]*freedWait           // lock key → the wait of this node's callers
}

// freedWait is the wait of a node's callers for a key: c is closed when its release is
// heard.
type freedWait struct {
	c       chan struct{}
	callers int
}

func newNode(prefix string) *node {
	id := rand.Text()
	return &node{id: id, channel: prefix + "node:" + id, wants: map[string]map[string]time.Time{}, waits: map[string]*freedWait{}}
}

// token is a fresh token naming the node.
func (n *node) token() string { return n.id + "." + rand.Text() }

// channelOf is the channel of the node that holder (a lock's token) names, or "".
func (n *node) channelOf(holder string) string {
	id, _, ok := strings.Cut(holder, ".")
	if !ok || id == "" || id == n.id {
		return ""
	}
	return strings.TrimSuffix(n.channel, n.id) + id
}

// The messages: a caller waits for a lock key (want, with its node's channel), and a
// lock key was released (free).
const (
	wantTag = "w\x1f"
	freeTag = "f\x1f"
)

func wantMessage(rkey, channel string) string { return wantTag + rkey + "\x1f" + channel }

// subscriber is the part of a go-redis client that listens to pub/sub.
type subscriber interface {
	Subscribe(ctx context.Context, channels ...string) *redis.PubSub
}

// listen subscribes the node to its channel, once.
func (b *Batcher) listen() {
	n := b.node
	n.start.Do(func() {
		sub, ok := b.locker.client.(subscriber)
		if !ok {
			return
		}
		n.mu.Lock()
		n.ps = sub.Subscribe(context.Background(), n.channel)
		ch := n.ps.Channel()
		n.mu.Unlock()
		go n.run(ch)
	})
}

// run takes the node's messages until its subscription is closed.
func (n *node) run(ch <-chan *redis.Message) {
	for m := range ch {
		switch {
		case strings.HasPrefix(m.Payload, wantTag):
			rkey, from, ok := strings.Cut(strings.TrimPrefix(m.Payload, wantTag), "\x1f")
			if ok {
				n.heardWant(rkey, from)
			}
		case strings.HasPrefix(m.Payload, freeTag):
			n.heardFree(strings.TrimPrefix(m.Payload, freeTag))
		}
	}
}

func (n *node) heardWant(rkey, from string) {
	now := time.Now()
	n.mu.Lock()
	defer n.mu.Unlock()
	if len(n.wants) > 1024 && now.Sub(n.pruned) > wantFresh { // keys wanted while held elsewhere, or never released here
		n.pruned = now
		for k, ws := range n.wants {
			for c, at := range ws {
				if now.Sub(at) > wantFresh {
					delete(ws, c)
				}
			}
			if len(ws) == 0 {
				delete(n.wants, k)
			}
		}
	}
	ws := n.wants[rkey]
	if ws == nil {
		ws = map[string]time.Time{}
		n.wants[rkey] = ws
	}
	ws[from] = now
}

func (n *node) heardFree(rkey string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if f := n.waits[rkey]; f != nil {
		close(f.c)
		delete(n.waits, rkey)
	}
}

// Wanted reports whether a caller of another Batcher found lk held and still waits for
// it (Obtain with Options.Want).
func (b *Batcher) Wanted(lk *Lock) bool {
	n := b.node
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, at := range n.wants[lk.rkey] {
		if time.Since(at) <= wantFresh {
			return true
		}
	}
	return false
}

// Freed returns a channel that is closed when this Batcher hears that key's lock was
// released by a Batcher whose lock this one's callers wanted; call done when no longer
// waiting. Take it right after the Obtain that found the key held: the holder hears of
// the wait after that, so its release is not missed.
func (b *Batcher) Freed(key string) (freed <-chan struct{}, done func()) {
	b.listen()
	n, rkey := b.node, b.locker.RedisKey(key)
	n.mu.Lock()
	defer n.mu.Unlock()
	f := n.waits[rkey]
	if f == nil {
		f = &freedWait{c: make(chan struct{})}
		n.waits[rkey] = f
	}
	f.callers++
	return f.c, func() {
		n.mu.Lock()
		defer n.mu.Unlock()
		if f.callers--; f.callers == 0 && n.waits[rkey] == f {
			delete(n.waits, rkey)
		}
	}
}

// Wake queues the message that tells the Batchers whose callers wanted lk that it is
// released. Queue it after lk's release (Release, or a Call sent before it).
func (b *Batcher) Wake(lk *Lock) {
	n := b.node
	n.mu.Lock()
	ws := n.wants[lk.rkey]
	delete(n.wants, lk.rkey)
	n.mu.Unlock()
	if len(ws) == 0 {
		return
	}
	args := make([]any, 1, len(ws)+1)
	args[0] = freeTag + lk.rkey
	for c := range ws {
		args = append(args, c)
	}
	b.Send(Call{Script: wakeScript, Args: args})
}

// Close ends the Batcher's subscription (the wake-ups). Its other work goes on.
func (b *Batcher) Close() error {
	n := b.node
	n.start.Do(func() {}) // no subscription after Close
	n.mu.Lock()
	ps := n.ps
	n.ps = nil
	n.mu.Unlock()
	if ps == nil {
		return nil
	}
	return ps.Close()
}
