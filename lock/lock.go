package lock

import (
	"context"
	"crypto/rand"
	_ "embed"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// DefaultPrefix is prepended to every lock key unless Config.Prefix says otherwise.
const DefaultPrefix = "idemq:lock:"

var (
	// ErrNotObtained is returned by Obtain (Locker's and Batcher's) when the key is held
	// by someone else and no retries are left.
	ErrNotObtained = errors.New("lock: not obtained")

	// ErrLockLost means the lock no longer holds our token: it expired, was deleted, or
	// was taken by another holder after it expired. Refresh, Release and TTL return it;
	// Batcher.Keep reports it (or an error wrapping it) as the cause of a loss.
	ErrLockLost = errors.New("lock: lost")
)

// Client is the part of a go-redis client the package needs. *redis.Client,
// *redis.ClusterClient, *redis.Ring and every redis.UniversalClient satisfy it.
type Client interface {
	redis.Scripter
	SetNX(ctx context.Context, key string, value any, expiration time.Duration) *redis.BoolCmd
	// Pipeline is what a Batcher sends its commands with.
	Pipeline() redis.Pipeliner
}

var (
	_ Client = (*redis.Client)(nil)
	_ Client = (*redis.ClusterClient)(nil)
	_ Client = (*redis.Ring)(nil)
	_ Client = redis.UniversalClient(nil)
)

var (
	//go:embed release.lua
	releaseLua    string
	releaseScript = redis.NewScript(releaseLua)

	//go:embed refresh.lua
	refreshLua    string
	refreshScript = redis.NewScript(refreshLua)

	//go:embed pttl.lua
	pttlLua    string
	pttlScript = redis.NewScript(pttlLua)
)

// pttlNotOurs is what pttl.lua returns when the key does not hold our token.
const pttlNotOurs = -3

// Config configures a Locker. The zero value (or a nil *Config) gives the defaults.
type Config struct {
	// Prefix is prepended to every key to form its Redis key. Default: DefaultPrefix
	// ("idemq:lock:").
	Prefix string

	// Logger receives the transient refresh errors and the losses of the locks a
	// Batcher keeps (Batcher.Keep). Default: discard.
	Logger *slog.Logger
}

// Locker obtains locks on one Redis deployment. It is safe for concurrent use.
type Locker struct {
	client Client
	prefix string
	log    *slog.Logger
}

// New returns a Locker that runs its commands on client. cfg may be nil.
func New(client Client, cfg *Config) *Locker {
	l := &Locker{client: client, prefix: DefaultPrefix, log: slog.New(slog.DiscardHandler)}
	if cfg != nil {
		if cfg.Prefix != "" {
			l.prefix = cfg.Prefix
		}
		if cfg.Logger != nil {
			l.log = cfg.Logger
		}
	}
	return l
}

// Client returns the client the Locker runs its commands on.
func (l *Locker) Client() Client { return l.client }

// RedisKey returns the Redis key that holds the lock for key. It is the only place
// that builds lock keys.
func (l *Locker) RedisKey(key string) string { return l.prefix + key }

// Options configures Obtain. A nil *Options gives the defaults.
type Options struct {
	// Retry decides whether and when Obtain tries again while the key is held by
	// someone else. Default: NoRetry().
	Retry RetryStrategy

	// Want, when set, marks the key as wanted for this long each time Obtain finds it
	// held by someone else, so that its holder can tell (Locker.Wanted) that handing it
	// on within its own process would keep this caller waiting. Default: no mark.
	Want time.Duration
}

// wantedSuffix makes the Redis key of a lock's wanted mark (Options.Want).
const wantedSuffix = ":wanted"

// Wanted reports whether another caller found key held since the last call (Options.Want),
// and clears the mark.
func (l *Locker) Wanted(ctx context.Context, key string) (bool, error) {
	n, err := unmarkScript.Run(ctx, l.client, []string{l.RedisKey(key) + wantedSuffix}).Int64()
	if err != nil {
		return false, fmt.Errorf("lock: wanted %q: %w", key, err)
	}
	return n == 1, nil
}

// unmarkScript deletes a wanted mark, answering 1 if there was one. (The Client interface
// has no DEL: every go-redis client runs scripts.)
var unmarkScript = redis.NewScript(`return redis.call('del', KEYS[1])`)

// Obtain takes the lock on key for ttl with SET NX PX and a fresh random token.
//
// While the key is held by someone else, Obtain retries as opts.Retry says (by default
// it does not) and then returns ErrNotObtained. When ctx ends first it returns promptly
// with an error wrapping ctx.Err() (errors.Is context.Canceled or
// context.DeadlineExceeded). Redis errors are returned wrapped; a command that failed
// in flight may still have set the key, which then expires after ttl. ttl must be at
// least a millisecond and key must not be empty.
func (l *Locker) Obtain(ctx context.Context, key string, ttl time.Duration, opts *Options) (*Lock, error) {
	return l.obtain(ctx, key, ttl, opts, rand.Text(), l.setNX, l.markWanted)
}

// setNX sends one SET NX PX on its own.
func (l *Locker) setNX(ctx context.Context, rkey, token string, ttl time.Duration) (bool, string, error) {
	ok, err := l.client.SetNX(ctx, rkey, token, ttl).Result()
	return ok, "", err
}

// markWanted marks rkey wanted for want (Options.Want), best effort: without the mark
// the holder only keeps the lock longer.
func (l *Locker) markWanted(ctx context.Context, rkey, _ string, want time.Duration) {
	l.client.SetNX(ctx, rkey+wantedSuffix, "1", want)
}

// obtain is Obtain's loop, trying to set token with setNX (which answers the holder's
// token when it can tell) and marking a busy key wanted with mark.
func (l *Locker) obtain(ctx context.Context, key string, ttl time.Duration, opts *Options, token string,
	setNX func(ctx context.Context, rkey, token string, ttl time.Duration) (bool, string, error),
	mark func(ctx context.Context, rkey, holder string, want time.Duration)) (*Lock, error) {
	if key == "" {
		return nil, errors.New("lock: obtain: empty key")
	}
	if ttl < time.Millisecond {
		return nil, fmt.Errorf("lock: obtain %q: ttl %v is shorter than 1ms", key, ttl)
	}
	var retry RetryStrategy = noRetry{}
	var want time.Duration
	if opts != nil {
		if opts.Retry != nil {
			retry = opts.Retry
		}
		want = opts.Want
	}
	rkey := l.RedisKey(key)

	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for n := 1; ; n++ {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("lock: obtain %q: %w", key, err)
		}
		sent := time.Now()
		ok, holder, err := setNX(ctx, rkey, token, ttl)
		if err != nil {
			if cerr := ctx.Err(); cerr != nil && !errors.Is(err, cerr) {
				return nil, fmt.Errorf("lock: obtain %q: %w: %w", key, cerr, err)
			}
			return nil, fmt.Errorf("lock: obtain %q: %w", key, err)
		}
		if ok {
			return &Lock{locker: l, key: key, rkey: rkey, token: token, ttl: ttl, sent: sent}, nil
		}
		if want > 0 {
			mark(ctx, rkey, holder, want)
		}
		delay, again := retry.Backoff(n)
		if !again {
			return nil, ErrNotObtained
		}
		if timer == nil {
			timer = time.NewTimer(delay)
		} else {
			timer.Reset(delay)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("lock: obtain %q: %w", key, ctx.Err())
		case <-timer.C:
		}
	}
}

// Lock is a held lock. Its methods are safe for concurrent use.
type Lock struct {
	locker *Locker
	key    string
	rkey   string
	token  string

	mu   sync.Mutex
	ttl  time.Duration // set by the last successful Obtain or Refresh
	sent time.Time     // when that command was sent (monotonic)
}

// Key returns the key the lock was obtained for, without the prefix.
func (l *Lock) Key() string { return l.key }

// Token returns the random token that identifies this holder in Redis.
func (l *Lock) Token() string { return l.token }

// validUntil returns when the lock expires at the latest by our own monotonic clock:
// the send time of the last command that set its TTL, plus that TTL. Redis received
// the command after we sent it, so its expiry is no earlier than this.
func (l *Lock) validUntil() (time.Time, time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.sent.Add(l.ttl), l.ttl
}

// Remaining is how long the lock is still ours at least, by our own monotonic clock:
// from the send time of the last obtain or refresh that Redis confirmed, its TTL, less
// the time since. Zero or less: it may have expired.
func (l *Lock) Remaining() time.Duration {
	until, _ := l.validUntil()
	return time.Until(until)
}

// extended records a successful refresh sent at sent with ttl, unless a later one is
// already recorded.
func (l *Lock) extended(sent time.Time, ttl time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if sent.After(l.sent) {
		l.sent, l.ttl = sent, ttl
	}
}

// Refresh resets the lock's TTL to ttl, provided Redis still holds our token. It
// returns ErrLockLost when it does not (the lock expired or someone else holds it now;
// their lock is left untouched), and a wrapped error when Redis cannot be reached.
// ttl must be at least a millisecond.
func (l *Lock) Refresh(ctx context.Context, ttl time.Duration) error {
	if ttl < time.Millisecond {
		return fmt.Errorf("lock: refresh %q: ttl %v is shorter than 1ms", l.key, ttl)
	}
	sent := time.Now()
	n, err := refreshScript.Run(ctx, l.locker.client, []string{l.rkey}, l.token, ttl.Milliseconds()).Int64()
	if err != nil {
		return fmt.Errorf("lock: refresh %q: %w", l.key, err)
	}
	if n != 1 {
		return ErrLockLost
	}
	l.extended(sent, ttl)
	return nil
}

// Release deletes the lock, provided Redis still holds our token. It returns
// ErrLockLost when it does not (another holder's lock is left untouched), and a wrapped
// error when Redis cannot be reached. Releasing twice returns ErrLockLost the second
// time.
func (l *Lock) Release(ctx context.Context) error {
	n, err := releaseScript.Run(ctx, l.locker.client, []string{l.rkey}, l.token).Int64()
	if err != nil {
		return fmt.Errorf("lock: release %q: %w", l.key, err)
	}
	if n != 1 {
		return ErrLockLost
	}
	return nil
}

// TTL returns the lock's remaining time to live as Redis sees it, provided Redis still
// holds our token. It returns ErrLockLost when it does not, and a wrapped error when
// Redis cannot be reached. A negative duration means the key has no expiry (somebody
// removed it behind our back).
func (l *Lock) TTL(ctx context.Context) (time.Duration, error) {
	ms, err := pttlScript.Run(ctx, l.locker.client, []string{l.rkey}, l.token).Int64()
	if err != nil {
		return 0, fmt.Errorf("lock: ttl %q: %w", l.key, err)
	}
	if ms == pttlNotOurs {
		return 0, ErrLockLost
	}
	return time.Duration(ms) * time.Millisecond, nil
}
