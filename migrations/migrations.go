// Package migrations holds idemq's versioned SQL and applies it with goose.
//
// The SQL comes in two sets, both embedded, so the binary carries its schema:
//
//   - the core set (this directory): the ledger (processed_jobs), the outbox (job_intents,
//     redis_epochs) and the API's memory of Idempotency-Key headers
//     (api_idempotency_keys). Up applies it and records its versions in idemq_db_version.
//   - the example set (the example directory): the tables of the example handlers and of
//     the stand-in payment provider (wallet_entries, fakepay_requests, fakepay_charges).
//     `idemq migrate` applies it after the core set; UpExample applies it and records its
//     versions in idemq_example_db_version. Up never creates these tables: an
//     application using the library does not need them.
//
// A library user applies the core set beside the application's own migrations:
//
//	if _, err := migrations.Up(ctx, db); err != nil { // db: a *sql.DB on the schema
//		return err
//	}
//
// Neither set reads or writes goose's default version table (goose_db_version) or takes
// goose's default lock, so an application that migrates its own schema with goose can run
// idemq's migrations before its own, after them, or from inside one of its own
// migrations.
//
// Two processes migrating one schema at once are serialised by a Postgres session
// advisory lock whose id is derived from "idemq-migrations:" and the schema's name, so
// running `idemq migrate` from every replica is safe, and migrations of different schemas
// (parallel tests) do not wait for each other. A caller waits for another migrator for up
// to 5 minutes.
//
// Before idemq had version tables of its own, both sets were recorded in goose's
// default table, goose_db_version. Such a schema is carried over the first time a
// provider of this package takes its lock (Up, UpExample, a provider's Up, UpTo or
// Status): the versions an older idemq applied are recorded in idemq's version tables, so
// nothing runs again, and goose_db_version is left as it is. Which versions those are is
// read from the schema's objects (processed_jobs for the core set, fakepay_requests for
// the example's, then each later migration's table, column or constraint), never from
// goose_db_version, whose rows may be the application's under the same numbers.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"hash/fnv"
	"io/fs"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

// The version tables, one per set.
const (
	VersionTable        = "idemq_db_version"
	ExampleVersionTable = "idemq_example_db_version"
)

// Core migrations are the *.sql files of this directory; the example's are in example/.
// A new migration goes into the set its tables belong to, numbered after that set's last.
var (
	//go:embed *.sql
	coreFiles embed.FS
	//go:embed example/*.sql
	exampleDir embed.FS
)

// set is one embedded set of migrations and what it needs to be applied on its own.
type set struct {
	name  string // in messages: "core" or "example"
	table string
	files fs.FS
	// legacy are the versions an older idemq recorded in goose_db_version, in order,
	// each with a test for the object it left.
	legacy []legacyVersion
}

var (
	core = &set{
		name:   "core",
		table:  VersionTable,
		files:  coreFiles,
		legacy: coreLegacy,
	}
	example = &set{
		name:   "example",
		table:  ExampleVersionTable,
		files:  mustSub(exampleDir, "example"),
		legacy: exampleLegacy,
	}
)

func mustSub(fsys fs.FS, dir string) fs.FS {
	sub, err := fs.Sub(fsys, dir)
	if err != nil {
		panic(err)
	}
	return sub
}

// NewProvider returns a goose provider for the core migrations on db, with idemq's
// version table and lock. Whatever the provider does under its lock (Up, UpTo, Status,
// …) starts by carrying over a schema an older idemq recorded in goose_db_version (see
// the package documentation).
func NewProvider(ctx context.Context, db *sql.DB) (*goose.Provider, error) {
	return core.provider(ctx, db)
}

// NewExampleProvider is NewProvider for the example's migrations: the tables of the
// example handlers and of fakepay, which `idemq migrate` applies after the core set.
func NewExampleProvider(ctx context.Context, db *sql.DB) (*goose.Provider, error) {
	return example.provider(ctx, db)
}

// Up applies every pending core migration and returns what it applied (nothing when the
// schema is current). It does not create the example's tables (see UpExample). It is
// safe to call from several processes at once, and from inside an application's own
// goose migration.
func Up(ctx context.Context, db *sql.DB) ([]*goose.MigrationResult, error) {
	return core.up(ctx, db)
}

// UpExample applies every pending migration of the example set: the tables of the
// example handlers (wallet_entries) and of the stand-in payment provider (fakepay_*). Only
// the example needs them; `idemq migrate` calls it after Up.
func UpExample(ctx context.Context, db *sql.DB) ([]*goose.MigrationResult, error) {
	return example.up(ctx, db)
}

func (s *set) provider(ctx context.Context, db *sql.DB) (*goose.Provider, error) {
	var schema string
	if err := db.QueryRowContext(ctx, "SELECT current_schema()").Scan(&schema); err != nil {
		return nil, fmt.Errorf("migrations: read current schema: %w", err)
	}
	// Wait for another migrator for up to 5 minutes, checking every second.
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(lockID(schema)), lock.WithLockTimeout(1, 300))
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, s.files,
		goose.WithTableName(s.table),
		goose.WithSessionLocker(carryOverLocker{SessionLocker: locker, set: s}),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	return p, nil
}

func (s *set) up(ctx context.Context, db *sql.DB) ([]*goose.MigrationResult, error) {
	p, err := s.provider(ctx, db)
	if err != nil {
		return nil, err
	}
	res, err := p.Up(ctx)
	if err != nil {
		return res, fmt.Errorf("migrations: up (%s): %w", s.name, err)
	}
	return res, nil
}

// lockID is the advisory lock both sets take on schema: never goose's default, which an
// application's own goose migrations hold while they run.
func lockID(schema string) int64 {
	h := fnv.New64a()
	h.Write([]byte("idemq-migrations:" + schema))
	return int64(h.Sum64() >> 1)
}
