package localserver

import (
	"context"
	"fmt"
	"net/url"

	"github.com/jackc/pgx/v5"
)

// Schema is a Postgres schema of its own on a shared server (for a test, a demo phase, a
// benchmark run): its tables cannot meet anyone else's.
type Schema struct {
	// Name is the schema's name.
	Name string
	// URL is the base URL with search_path set to the schema (pgx sends unknown URL
	// parameters as run-time parameters), so every connection made from it uses only the
	// schema.
	URL string

	base string
}

// CreateSchema creates the schema name on the database at base (a postgres:// URL) and
// returns it; params are added to its URL (e.g. application_name). Drop removes it.
func CreateSchema(ctx context.Context, base, name string, params map[string]string) (*Schema, error) {
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return nil, fmt.Errorf("the database must be given as a postgres:// URL, got %s", Redact(base))
	}
	q := u.Query()
	q.Set("search_path", name)
	for k, v := range params {
		q.Set(k, v)
	}
	u.RawQuery = q.Encode()

	conn, err := pgx.Connect(ctx, base)
	if err != nil {
		return nil, fmt.Errorf("Postgres at %s does not answer: %w", Redact(base), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		return nil, fmt.Errorf("create schema %s: %w", name, err)
	}
	return &Schema{Name: name, URL: u.String(), base: base}, nil
}

// Drop removes the schema and everything in it, on a connection of its own.
func (s *Schema) Drop(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, s.base)
	if err != nil {
		return fmt.Errorf("drop schema %s: %w", s.Name, err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{s.Name}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("drop schema %s: %w", s.Name, err)
	}
	return nil
}

// Redact returns dsn without its password, for messages.
func Redact(dsn string) string {
	u, err := url.Parse(dsn)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
}
