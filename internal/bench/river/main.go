// Command riverdrain drains wallet debits through River (github.com/riverqueue/river,
// the riverpgxv5 driver), each exactly once the way River's documentation has it: the
// worker writes the debit's wallet entry and completes its job (river.JobCompleteTx) in
// one transaction. It is `idemq-bench -drain -drain-river`'s comparison, in a module of
// its own so that idemq's module does not depend on River.
//
// Usage:
//
//	DATABASE_URL=postgres://... riverdrain -n 10000 -concurrency 10
//
// It migrates River's tables (rivermigrate) and creates wallet_entries, in the shape of
// idemq's example table, where DATABASE_URL's search_path points (or in -schema), and
// empties river_job. It inserts -n jobs of kind wallet_debit before the clock starts,
// then starts a client with -concurrency workers on the default queue, fetching as
// eagerly as River allows (FetchCooldown and FetchPollInterval 1ms), and times from
// the first job fetched to the last one completed. It prints one JSON line:
// deliveries, seconds, per_second, cpu_user_sys_seconds (this process, from the client's
// start to the last completion), effects (wallet entries written). It exits non-zero
// when effects is not -n.
//
// With -wait it prints "ready" once the jobs are in, starts on a line from stdin, and
// after its JSON line keeps its connections open until stdin closes, so that a caller
// can read its Postgres backends' CPU time.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

// DebitArgs is a wallet debit, the payload of idemq's wallet:debit task.
type DebitArgs struct {
	AccountID   string `json:"account_id"`
	AmountCents int64  `json:"amount_cents"`
	Reference   string `json:"reference"`
}

func (DebitArgs) Kind() string { return "wallet_debit" }

// walletDDL is idemq's example table (migrations/example), created if missing.
const walletDDL = `
CREATE TABLE IF NOT EXISTS wallet_entries (
    id           bigserial   PRIMARY KEY,
    account_id   text        NOT NULL,
    amount_cents bigint      NOT NULL,
    reference    text        NOT NULL,
    fence        bigint      NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS wallet_entries_reference_idx ON wallet_entries (reference);
CREATE INDEX IF NOT EXISTS wallet_entries_account_idx ON wallet_entries (account_id);`

// insertEntry is the statement idemq's debit handler runs.
const insertEntry = `INSERT INTO wallet_entries (account_id, amount_cents, reference, fence)
	VALUES ($1, $2, $3, 0) RETURNING id, created_at`

// debitWorker writes a debit's wallet entry and completes its job in one transaction.
type debitWorker struct {
	river.WorkerDefaults[DebitArgs]
	pool    *pgxpool.Pool
	n       int64
	first   sync.Once
	began   time.Time
	done    atomic.Int64
	drained chan struct{}
}

func (w *debitWorker) Work(ctx context.Context, job *river.Job[DebitArgs]) error {
	w.first.Do(func() { w.began = time.Now() })
	err := pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
		var id int64
		var at time.Time
		if err := tx.QueryRow(ctx, insertEntry, job.Args.AccountID, job.Args.AmountCents, job.Args.Reference).Scan(&id, &at); err != nil {
			return err
		}
		_, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job)
		return err
	})
	if err != nil {
		return err
	}
	if w.done.Add(1) == w.n {
		close(w.drained)
	}
	return nil
}

// Result is riverdrain's output.
type Result struct {
	Deliveries     int     `json:"deliveries"`
	Seconds        float64 `json:"seconds"`
	PerSecond      float64 `json:"per_second"`
	CPUUserSys     float64 `json:"cpu_user_sys_seconds"`
	StartupSeconds float64 `json:"startup_seconds"` // from the client's start to the first job fetched
	Effects        int     `json:"effects"`
	Concurrency    int     `json:"concurrency"`
	PoolSize       int32   `json:"pool_size"`
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "riverdrain:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdin io.Reader, stdout io.Writer) error {
	fs := flag.NewFlagSet("riverdrain", flag.ContinueOnError)
	n := fs.Int("n", 10000, "debits to drain")
	conc := fs.Int("concurrency", 10, "MaxWorkers of the default queue")
	pool := fs.Int("pool", 0, "Postgres connections (0: idemq worker's default, min(concurrency+4, 4 × cores + 8))")
	accounts := fs.Int("accounts", 0, "debit accounts, debit i going to account i mod accounts (0: one account per debit)")
	prefix := fs.String("prefix", "", "the debits' references are PREFIX-i (default: river and the time)")
	cooldown := fs.Duration("fetch-cooldown", river.FetchCooldownMin, "River's FetchCooldown: the least time between two fetches")
	poll := fs.Duration("fetch-poll", river.FetchPollIntervalMin, "River's FetchPollInterval")
	schema := fs.String("schema", "", "run in this schema, created if missing (default: DATABASE_URL's search_path)")
	wait := fs.Bool("wait", false, `print "ready" once the jobs are in, start on a line from stdin, and after the result hold the connections until stdin closes`)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *n < 1 || *conc < 1 {
		return errors.New("-n and -concurrency must be positive")
	}
	if *prefix == "" {
		*prefix = "river" + strconv.FormatInt(time.Now().UnixNano(), 36)
	}
	cfg, err := pgxpool.ParseConfig(os.Getenv("DATABASE_URL"))
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	cfg.MaxConns = int32(min(*conc+4, 4*runtime.NumCPU()+8))
	if *pool > 0 {
		cfg.MaxConns = int32(*pool)
	}
	if *schema != "" {
		cfg.ConnConfig.RuntimeParams["search_path"] = *schema
		conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig.Copy())
		if err != nil {
			return err
		}
		// search_path names a schema that may not exist yet: the connection still opens.
		_, err = conn.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{*schema}.Sanitize())
		conn.Close(ctx)
		if err != nil {
			return err
		}
	}
	db, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer db.Close()

	driver := riverpgxv5.New(db)
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	migrator, err := rivermigrate.New(driver, &rivermigrate.Config{Logger: quiet})
	if err != nil {
		return err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fmt.Errorf("migrate River: %w", err)
	}
	if _, err := db.Exec(ctx, walletDDL); err != nil {
		return fmt.Errorf("create wallet_entries: %w", err)
	}
	if _, err := db.Exec(ctx, "TRUNCATE river_job"); err != nil {
		return err
	}

	w := &debitWorker{pool: db, n: int64(*n), drained: make(chan struct{})}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	client, err := river.NewClient(driver, &river.Config{
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: *conc}},
		Workers:           workers,
		FetchCooldown:     *cooldown,
		FetchPollInterval: *poll,
		Logger:            quiet,
	})
	if err != nil {
		return err
	}
	params := make([]river.InsertManyParams, *n)
	for i := range params {
		acct := i
		if *accounts > 0 {
			acct = i % *accounts
		}
		params[i] = river.InsertManyParams{Args: DebitArgs{AccountID: "acct-" + strconv.Itoa(acct), AmountCents: 1, Reference: *prefix + "-" + strconv.Itoa(i)}}
	}
	if _, err := client.InsertManyFast(ctx, params); err != nil {
		return fmt.Errorf("insert jobs: %w", err)
	}

	in := bufio.NewReader(stdin)
	if *wait {
		fmt.Fprintln(stdout, "ready")
		if _, err := in.ReadString('\n'); err != nil {
			return fmt.Errorf("wait for the start: %w", err)
		}
	}
	cpu0 := cpuSeconds()
	started := time.Now()
	if err := client.Start(ctx); err != nil {
		return err
	}
	select {
	case <-w.drained:
	case <-ctx.Done():
		return ctx.Err()
	}
	ended := time.Now()
	res := Result{Deliveries: *n, Concurrency: *conc, PoolSize: cfg.MaxConns}
	res.CPUUserSys = cpuSeconds() - cpu0
	res.Seconds = ended.Sub(w.began).Seconds()
	res.PerSecond = float64(*n) / res.Seconds
	res.StartupSeconds = w.began.Sub(started).Seconds()
	if err := client.Stop(ctx); err != nil {
		return err
	}
	if err := db.QueryRow(ctx, `SELECT count(*) FROM wallet_entries WHERE reference LIKE $1`, *prefix+"-%").Scan(&res.Effects); err != nil {
		return err
	}
	if err := json.NewEncoder(stdout).Encode(res); err != nil {
		return err
	}
	if *wait {
		io.Copy(io.Discard, in)
	}
	if res.Effects != *n {
		return fmt.Errorf("%d wallet entries for %d debits", res.Effects, *n)
	}
	return nil
}

// cpuSeconds is this process's user and system CPU time so far.
func cpuSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
}
