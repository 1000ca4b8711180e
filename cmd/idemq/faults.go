package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/tasks"
)

// Test-only fault points (IDEMQ_UNSAFE_FAULTS), used by internal/faults.
//
// They make a worker SIGKILL itself at a chosen point of a handler, with a probability:
// after_claim (first thing in the handler, the claim committed), after_effect (after the
// provider call or the wallet insert, before the handler returns, so before the
// completion); debit_delay adds a random delay up to the given duration to each debit;
// debit_error makes a debit's first delivery fail (a retryable error) after its wallet
// insert, with a probability, so that the insert rolls back with its transaction and the
// task is retried (a shared transaction without savepoints is rolled back, and its
// deliveries run again); a retry does not fail, so no task waits for more than one.
// Empty (the default) changes nothing.

type faultPoints struct {
	afterClaim, afterEffect, debitError float64
	debitDelay                          time.Duration
}

func parseFaultPoints(spec string) (faultPoints, error) {
	var fp faultPoints
	for _, item := range strings.Split(spec, ",") {
		if item = strings.TrimSpace(item); item == "" {
			continue
		}
		name, val, _ := strings.Cut(item, ":")
		switch name {
		case "after_claim", "after_effect", "debit_error":
			p, err := strconv.ParseFloat(val, 64)
			if err != nil || p < 0 || p > 1 {
				return fp, fmt.Errorf("%s: want a probability between 0 and 1, got %q", name, val)
			}
			switch name {
			case "after_claim":
				fp.afterClaim = p
			case "after_effect":
				fp.afterEffect = p
			default:
				fp.debitError = p
			}
		case "debit_delay":
			d, err := time.ParseDuration(val)
			if err != nil || d < 0 {
				return fp, fmt.Errorf("debit_delay: want a duration, got %q", val)
			}
			fp.debitDelay = d
		default:
			return fp, fmt.Errorf("unknown fault point %q (after_claim, after_effect, debit_delay, debit_error)", name)
		}
	}
	return fp, nil
}

// crash kills the process with probability p, logging the point first.
func (fp faultPoints) crash(point string, p float64, key string, log *slog.Logger) {
	if p > 0 && mrand.Float64() < p {
		log.Warn("IDEMQ_UNSAFE_FAULTS: SIGKILL at fault point", "point", point, "key", key)
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is on its way
	}
}

// wrap puts the fault points around the charge handler (see wrapDebit for the debit's).
func (fp faultPoints) wrap(charge func(context.Context, tasks.Charge) (json.RawMessage, error), log *slog.Logger) func(context.Context, tasks.Charge) (json.RawMessage, error) {
	if fp == (faultPoints{}) {
		return charge
	}
	log.Warn("IDEMQ_UNSAFE_FAULTS is set: this worker kills itself on purpose (tests only)", "after_claim", fp.afterClaim, "after_effect", fp.afterEffect, "debit_delay", fp.debitDelay, "debit_error", fp.debitError)
	return func(ctx context.Context, c tasks.Charge) (json.RawMessage, error) {
		fp.crash("after_claim", fp.afterClaim, c.Key(), log)
		out, err := charge(ctx, c)
		if err == nil {
			fp.crash("after_effect", fp.afterEffect, c.Key(), log)
		}
		return out, err
	}
}

// wrapDebit is wrap for the debit handler, whatever its transaction (a pgx.Tx, a *sql.Tx).
func wrapDebit[X any](fp faultPoints, debit func(context.Context, X, tasks.Debit) (json.RawMessage, error), log *slog.Logger) func(context.Context, X, tasks.Debit) (json.RawMessage, error) {
	if fp == (faultPoints{}) {
		return debit
	}
	return func(ctx context.Context, tx X, d tasks.Debit) (json.RawMessage, error) {
		fp.crash("after_claim", fp.afterClaim, d.Key(), log)
		if fp.debitDelay > 0 {
			select {
			case <-time.After(mrand.N(fp.debitDelay)):
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		out, err := debit(ctx, tx, d)
		if err == nil {
			fp.crash("after_effect", fp.afterEffect, d.Key(), log)
			if n, _ := asynq.GetRetryCount(ctx); n == 0 && fp.debitError > 0 && mrand.Float64() < fp.debitError {
				return nil, fmt.Errorf("IDEMQ_UNSAFE_FAULTS: debit_error after the wallet insert of %s (rolled back; retried)", d.Key())
			}
		}
		return out, err
	}
}
