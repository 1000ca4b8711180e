package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"time"
)

// healthcheckCommand probes a URL, for container healthchecks in images without curl.
func healthcheckCommand() command {
	return command{
		name:    "healthcheck",
		usage:   "healthcheck URL",
		summary: "exit 0 when URL answers 200 within 3 seconds (for container healthchecks)",
		run: func(ctx context.Context, _ any, args []string, stdout, _ io.Writer) error {
			if len(args) != 1 {
				return fmt.Errorf("healthcheck: want one URL, got %d arguments", len(args))
			}
			ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, args[0], nil)
			if err != nil {
				return fmt.Errorf("healthcheck: %w", err)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return fmt.Errorf("healthcheck: %w", err)
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("healthcheck: %s answered %s", args[0], resp.Status)
			}
			fmt.Fprintln(stdout, "ok")
			return nil
		},
	}
}
