package migrations

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"hash/fnv"
	"io/fs"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
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
// schema is current). It refuses, applying nothing, when a pending contract step needs a
// newer schema than a live registered process runs (a *ContractError; see Step). It does
// not create the example's tables (see UpExample). It is safe to call from several
// processes at once, and from inside an application's own goose migration.
func Up(ctx context.Context, db *sql.DB) ([]*goose.MigrationResult, error) {
	return core.up(ctx, db)
}

// UpPool is Up through a pgx pool, for an application that holds a *pgxpool.Pool rather
// than a *sql.DB: it opens a database/sql handle on pool (stdlib.OpenDBFromPool), applies
// the pending core migrations and closes the handle, leaving pool open. It returns what
// Up returns (a *ContractError when a contract step is refused).
func UpPool(ctx context.Context, pool *pgxpool.Pool) ([]*goose.MigrationResult, error) {
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	return Up(ctx, db)
}

// UpExample applies every pending migration of the example set: the tables of the
// example handlers (wallet_entries) and of the stand-in payment provider (fakepay_*). Only
// the example needs them; `idemq migrate` calls it after Up. It refuses contract steps as
// Up does.
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
	if err := s.check(ctx, db); err != nil {
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

// A Migration is one migration of the core or the example set, applied or pending.
type Migration struct {
	Set string // "core" or "example"
	Step
	Applied bool
	// AppliedAt is when the set's version table recorded it: zero while pending, and for a
	// migration an older idemq applied that the next Up records (see the package
	// documentation).
	AppliedAt time.Time
}

// Status lists the migrations of both sets, core first, each with its kind and whether
// and when it was applied. It only reads: it creates no version table and carries
// nothing over (a schema an older idemq recorded in goose_db_version shows what the next
// Up would record), so a schema it looked at is left exactly as it was.
func Status(ctx context.Context, db *sql.DB) ([]Migration, error) {
	var out []Migration
	for _, s := range []*set{core, example} {
		list, err := s.status(ctx, db)
		if err != nil {
			return nil, err
		}
		out = append(out, list...)
	}
	return out, nil
}

// Check returns what Up followed by UpExample would refuse (a *ContractError), or nil.
// Like Status, it only reads.
func Check(ctx context.Context, db *sql.DB) error {
	for _, s := range []*set{core, example} {
		if err := s.check(ctx, db); err != nil {
			return err
		}
	}
	return nil
}
