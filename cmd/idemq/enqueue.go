package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/config"
	"github.com/idemq/idemq/internal/dial"
	"github.com/idemq/idemq/tasks"
)

func enqueueCommand() command {
	return command{
		name:    "enqueue",
		usage:   "enqueue charge --order-id ID --customer-id ID --amount-cents N [--currency EUR] | enqueue debit --account-id ID --amount-cents N --reference REF | enqueue checkout --order-id ID --customer-id ID --amount-cents N [--currency EUR] --email ADDR",
		summary: "record one example job in the outbox and publish it; prints its key and whether it was new or a duplicate",
		spec:    func() any { return &config.Enqueue{} },
		traced:  "idemq-enqueue",
		run: func(ctx context.Context, spec any, args []string, stdout, stderr io.Writer) error {
			cfg := spec.(*config.Enqueue)
			if len(args) == 0 {
				return fmt.Errorf("enqueue: say what: charge, debit or checkout")
			}
			fs := flag.NewFlagSet("enqueue "+args[0], flag.ContinueOnError)
			fs.SetOutput(stderr)
			var (
				job outbox.Spec
				err error
			)
			switch args[0] {
			case "charge":
				var c tasks.Charge
				fs.StringVar(&c.OrderID, "order-id", "", "order to charge (the key is charge:<order-id>)")
				fs.StringVar(&c.CustomerID, "customer-id", "", "customer charged (lock scope customer:<customer-id>)")
				fs.Int64Var(&c.AmountCents, "amount-cents", 0, fmt.Sprintf("amount in cents, 1 to %d", tasks.MaxAmountCents))
				fs.StringVar(&c.Currency, "currency", "EUR", "ISO 4217 currency code")
				if err := fs.Parse(args[1:]); err != nil {
					return err
				}
				if err := c.Canonical().Validate(); err != nil {
					return flagError(err)
				}
				job, err = tasks.ChargeSpec(c)
			case "debit":
				var d tasks.Debit
				fs.StringVar(&d.AccountID, "account-id", "", "account debited (lock scope account:<account-id>)")
				fs.Int64Var(&d.AmountCents, "amount-cents", 0, fmt.Sprintf("amount in cents, 1 to %d", tasks.MaxAmountCents))
				fs.StringVar(&d.Reference, "reference", "", "debit reference (the key is debit:<reference>)")
				if err := fs.Parse(args[1:]); err != nil {
					return err
				}
				if err := d.Validate(); err != nil {
					return flagError(err)
				}
				job, err = tasks.DebitSpec(d)
			case "checkout":
				var c tasks.Checkout
				fs.StringVar(&c.OrderID, "order-id", "", "order checked out (the key is checkout:<order-id>)")
				fs.StringVar(&c.CustomerID, "customer-id", "", "customer charged (lock scope customer:<customer-id>)")
				fs.Int64Var(&c.AmountCents, "amount-cents", 0, fmt.Sprintf("amount in cents, 1 to %d", tasks.MaxAmountCents))
				fs.StringVar(&c.Currency, "currency", "EUR", "ISO 4217 currency code")
				fs.StringVar(&c.Email, "email", "", fmt.Sprintf("address the receipt goes to, at most %d bytes", tasks.MaxEmailBytes))
				if err := fs.Parse(args[1:]); err != nil {
					return err
				}
				if err := c.Canonical().Validate(); err != nil { // names the email, never quotes it
					return flagError(err)
				}
				job, err = tasks.CheckoutSpec(c)
			default:
				return fmt.Errorf("enqueue: unknown task %q (charge, debit or checkout)", args[0])
			}
			if err != nil {
				return err
			}
			if fs.NArg() > 0 {
				return fmt.Errorf("enqueue %s: unexpected arguments %q", args[0], fs.Args())
			}
			rdb, err := dial.Redis(ctx, cfg.RedisURL, cfg.RedisCluster)
			if err != nil {
				return err
			}
			defer rdb.Close()
			pool, err := dial.Postgres(ctx, cfg.DatabaseURL, 2)
			if err != nil {
				return err
			}
			defer pool.Close()
			if err := requireSchema(ctx, pool, "enqueue", exampleSchema); err != nil {
				return err
			}
			// Traced, the job's deliveries join the trace of this command: a span of its
			// own, continuing TRACEPARENT when a calling script passes one.
			stopTracing, err := startTracing(ctx, "idemq-enqueue", newLogger(stderr, "warn"))
			if err != nil {
				return err
			}
			defer stopTracing()
			ctx, span := otel.Tracer("github.com/idemq/idemq/cmd/idemq").Start(
				idempotency.ContextWithTraceParent(ctx, os.Getenv("TRACEPARENT")), "enqueue "+job.Type)
			span.SetAttributes(idempotency.AttrKey.String(job.Key))
			res, err := outbox.NewClient(pool, rdb, nil).Enqueue(ctx, job)
			if err != nil {
				span.SetStatus(codes.Error, err.Error())
			}
			span.End()
			if err != nil {
				return fmt.Errorf("enqueue %s: %w", job.Key, err)
			}
			if res.Duplicate {
				fmt.Fprintf(stdout, "%s\tduplicate (already accepted; %s)\n", res.Key, res.State)
			} else {
				fmt.Fprintf(stdout, "%s\taccepted (%s)\n", res.Key, res.State)
			}
			return nil
		},
	}
}

// flagError renames the payload field that err, a Validate error, starts with to the
// flag that sets it: "order_id: required" becomes "--order-id: required".
func flagError(err error) error {
	field, rest, ok := strings.Cut(err.Error(), ": ")
	if !ok || field == "" || strings.Trim(field, "abcdefghijklmnopqrstuvwxyz_") != "" {
		return err
	}
	return fmt.Errorf("--%s: %s", strings.ReplaceAll(field, "_", "-"), rest)
}
