package dial

import (
	"context"
	"fmt"
	"log/slog"
	"strings"

	"github.com/redis/go-redis/v9"
)

// SetRedisLogger sends go-redis's own log lines, which it otherwise prints to stderr in
// a format of its own, to log: a failed dial at debug level (the command that needed the
// connection gets the same error and reports it once), a failure or error at warn level,
// the rest (a Sentinel's new master, a cluster's moved slots) at info level. go-redis has
// one logger per process, so the last call wins.
func SetRedisLogger(log *slog.Logger) {
	redis.SetLogger(redisLog{log.With("component", "go-redis")})
}

type redisLog struct{ l *slog.Logger }

func (r redisLog) Printf(ctx context.Context, format string, v ...any) {
	msg := strings.TrimPrefix(fmt.Sprintf(format, v...), "redis: ")
	level := slog.LevelInfo
	switch lower := strings.ToLower(msg); {
	case strings.Contains(lower, "failed to dial"):
		level = slog.LevelDebug
	case strings.Contains(lower, "fail"), strings.Contains(lower, "error"), strings.Contains(lower, "panic"),
		strings.Contains(lower, "unreachable"):
		level = slog.LevelWarn
	}
	r.l.Log(ctx, level, msg)
}
