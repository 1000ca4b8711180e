// Package httpserver runs an http.Handler until its context ends, then shuts it down
// within a timeout. Every connection is bounded: a slow client cannot hold one open by
// sending its request a byte at a time, an idle keep-alive is closed, and the number open
// at once is capped. A request framed by Transfer-Encoding closes its connection after
// the answer, so bytes a proxy may have framed differently are never read as another
// request.
package httpserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"golang.org/x/net/netutil"
)

// The defaults of Options.
const (
	DefaultShutdownTimeout   = 10 * time.Second
	DefaultReadHeaderTimeout = 10 * time.Second
	DefaultReadTimeout       = 30 * time.Second
	DefaultWriteTimeout      = 60 * time.Second
	DefaultIdleTimeout       = 30 * time.Second
	DefaultMaxConns          = 1024
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
	// Default DefaultIdleTimeout (30s).
	IdleTimeout time.Duration
	// MaxConns caps the connections open at once; past it a new connection waits in the
	// listen backlog until one closes. Default DefaultMaxConns (1024).
	MaxConns int
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
	maxConns := o.MaxConns
	if maxConns <= 0 {
		maxConns = DefaultMaxConns
	}
	ln = netutil.LimitListener(ln, maxConns)
	srv := &http.Server{
		Handler:           closeAfterTransferEncoding(h),
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

// closeAfterTransferEncoding closes the connection after a request that came with a
// Transfer-Encoding (RFC 9112 section 6.1): with a Content-Length beside it, an
// intermediary may have framed the body by the other header, and what net/http reads as
// the next request on the connection may be the tail of this one, smuggled. net/http
// drops the Content-Length before the handler runs, so any Transfer-Encoding closes.
func closeAfterTransferEncoding(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if len(r.TransferEncoding) > 0 {
			w.Header().Set("Connection", "close")
		}
		h.ServeHTTP(w, r)
	})
}
