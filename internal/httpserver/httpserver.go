// Package httpserver runs an http.Handler until its context ends, then shuts it down
// within a timeout. Every connection is bounded: a slow client cannot hold one open by
// sending its request a byte at a time, and an idle keep-alive is closed.
package httpserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"
)

// The defaults of Options.
const (
	DefaultShutdownTimeout   = 10 * time.Second
	DefaultReadHeaderTimeout = 10 * time.Second
	DefaultReadTimeout       = 30 * time.Second
	DefaultWriteTimeout      = 60 * time.Second
	DefaultIdleTimeout       = 120 * time.Second
)

// Options are a server's optional settings; a zero field (or nil Options) means the
// default written on it.
type Options struct {
	// ShutdownTimeout is how long shutdown waits for requests in flight once ctx ends.
	// Default DefaultShutdownTimeout (10s).
	ShutdownTimeout time.Duration
	// ReadHeaderTimeout bounds reading a request's headers. Default
	// DefaultReadHeaderTimeout (10s).
	ReadHeaderTimeout time.Duration
	// ReadTimeout bounds reading a whole request, headers and body; a body still arriving
	// after it fails to read. Default DefaultReadTimeout (30s).
	ReadTimeout time.Duration
	// WriteTimeout bounds a request from the end of its headers to the end of its answer:
	// an answer not written by then is cut off, so keep it above the longest handler
	// (including the time it may spend reading the body, up to ReadTimeout). Default
	// DefaultWriteTimeout (60s).
	WriteTimeout time.Duration
	// IdleTimeout closes a keep-alive connection that sends no request for this long.
	// Default DefaultIdleTimeout (120s).
	IdleTimeout time.Duration
	// Ready, when not nil, receives the bound address once the listener is open (useful
	// with port 0).
	Ready func(net.Addr)
	// Listener, when not nil, is served instead of a new listener on addr, so a caller
	// can take its address before it starts anything else. Serve closes it.
	Listener net.Listener
}

// or returns d, or def when d is not positive.
func or(d, def time.Duration) time.Duration {
	if d > 0 {
		return d
	}
	return def
}

// Serve listens on addr and serves h until ctx is cancelled, then shuts down gracefully,
// waiting up to opts.ShutdownTimeout for requests in flight. opts may be nil.
func Serve(ctx context.Context, addr string, h http.Handler, log *slog.Logger, opts *Options) error {
	var o Options
	if opts != nil {
		o = *opts
	}
	ln := o.Listener
	if ln == nil {
		var err error
		if ln, err = net.Listen("tcp", addr); err != nil {
			return fmt.Errorf("listen on %s: %w", addr, err)
		}
	}
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: or(o.ReadHeaderTimeout, DefaultReadHeaderTimeout),
		ReadTimeout:       or(o.ReadTimeout, DefaultReadTimeout),
		WriteTimeout:      or(o.WriteTimeout, DefaultWriteTimeout),
		IdleTimeout:       or(o.IdleTimeout, DefaultIdleTimeout),
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		BaseContext:       func(net.Listener) context.Context { return context.WithoutCancel(ctx) },
	}
	log.Info("listening", "addr", ln.Addr().String())
	if o.Ready != nil {
		o.Ready(ln.Addr())
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), or(o.ShutdownTimeout, DefaultShutdownTimeout))
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		srv.Close()
		return fmt.Errorf("shut down %s: %w", addr, err)
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
