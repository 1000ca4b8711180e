package main

import (
	"context"
	"fmt"
	"io"

	"github.com/idemq/idemq/internal/config"
	"github.com/idemq/idemq/internal/dial"
	"github.com/idemq/idemq/internal/fakepay"
	"github.com/idemq/idemq/internal/httpserver"
	"github.com/idemq/idemq/internal/tracing"
)

func fakepayCommand() command {
	return command{
		name:    "fakepay",
		usage:   "fakepay",
		summary: "run the stand-in payment provider that payment:charge calls (honours Idempotency-Key like Stripe)",
		spec:    func() any { return &config.Fakepay{} },
		traced:  "idemq-fakepay",
		run: func(ctx context.Context, spec any, args []string, _, stderr io.Writer) error {
			cfg := spec.(*config.Fakepay)
			if len(args) > 0 {
				return fmt.Errorf("fakepay: unexpected arguments %q", args)
			}
			log := newLogger(stderr, cfg.LogLevel).With("cmd", "fakepay")
			ln, err := listen("IDEMQ_FAKEPAY_ADDR", cfg.Addr)
			if err != nil {
				return err
			}
			defer ln.Close() // Serve closes it too
			stopTracing, err := startTracing(ctx, "idemq-fakepay", log)
			if err != nil {
				return err
			}
			defer stopTracing()
			pool, err := dial.Postgres(ctx, cfg.DatabaseURL, 0)
			if err != nil {
				return err
			}
			defer pool.Close()
			if err := requireSchema(ctx, pool, "fakepay", exampleSchema); err != nil {
				return err
			}
			srv := fakepay.New(pool, fakepay.Config{HonorKeys: cfg.HonorKeys, Delay: cfg.Delay, Logger: log})
			log.Info("fakepay starting", "honor_keys", cfg.HonorKeys, "delay", cfg.Delay)
			// A request may sleep up to cfg.Delay before it answers.
			return httpserver.Serve(ctx, cfg.Addr, tracing.Handler(srv, "idemq-fakepay"), log, &httpserver.Options{
				ShutdownTimeout: defaultShutdown, WriteTimeout: cfg.Delay + httpserver.DefaultWriteTimeout, Listener: ln})
		},
	}
}
