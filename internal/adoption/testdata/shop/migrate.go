package shop

import (
	"context"
	"database/sql"
	"embed"
	"io/fs"

	"github.com/pressly/goose/v3"

	"github.com/idemq/idemq/migrations"
)

//go:embed migrations/*.sql
var files embed.FS

// Migrate applies idemq's migrations (version table idemq_db_version) and the shop's own
// (goose's goose_db_version) to db's schema.
func Migrate(ctx context.Context, db *sql.DB) error {
	if _, err := migrations.Up(ctx, db); err != nil {
		return err
	}
	dir, err := fs.Sub(files, "migrations")
	if err != nil {
		return err
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, dir)
	if err != nil {
		return err
	}
	_, err = p.Up(ctx)
	return err
}
