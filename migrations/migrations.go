// Package migrations holds idemq's versioned SQL and applies it with goose.
//
// The files are embedded, so the binary carries its schema. Apply them with Up; two
// processes migrating the same schema at once are serialised by a Postgres advisory lock
// (goose's session locker), so running `idemq migrate` from every replica is safe.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"hash/fnv"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed *.sql
var files embed.FS

// NewProvider returns a goose provider for the embedded migrations on db, locking with a
// Postgres advisory lock derived from db's current schema (goose's default lock id for
// "public"), so migrations of one schema are serialised and those of different schemas
// (parallel tests) are not.
func NewProvider(ctx context.Context, db *sql.DB) (*goose.Provider, error) {
	var schema string
	if err := db.QueryRowContext(ctx, "SELECT current_schema()").Scan(&schema); err != nil {
		return nil, fmt.Errorf("migrations: read current schema: %w", err)
	}
	// Wait for another migrator for up to 5 minutes, checking every second.
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(lockID(schema)), lock.WithLockTimeout(1, 300))
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, files,
		goose.WithSessionLocker(locker),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	return p, nil
}

// Up applies every pending migration and returns what it applied (nothing when the schema
// is current).
func Up(ctx context.Context, db *sql.DB) ([]*goose.MigrationResult, error) {
	p, err := NewProvider(ctx, db)
	if err != nil {
		return nil, err
	}
	res, err := p.Up(ctx)
	if err != nil {
		return res, fmt.Errorf("migrations: up: %w", err)
	}
	return res, nil
}

func lockID(schema string) int64 {
	if schema == "public" {
		return lock.DefaultLockID
	}
	h := fnv.New64a()
	h.Write([]byte("idemq-migrations:" + schema))
	return int64(h.Sum64() >> 1)
}
