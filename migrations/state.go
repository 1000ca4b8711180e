package migrations

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

// A querier is what reading a schema's state needs: a *sql.DB or a *sql.Conn.
type querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// recorded returns the versions of s applied to the current schema, each with the time
// its version table recorded it. It only reads: it neither creates the version table nor
// takes the migration lock. While the version table holds no version (it is missing, or
// holds only goose's version 0), the versions an older idemq applied are returned, with
// a zero time: those the next Up records when it carries the schema over (see carryOver).
func (s *set) recorded(ctx context.Context, q querier) (map[int64]time.Time, error) {
	exists, err := s.tableExists(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("migrations: read %s: %w", s.table, err)
	}
	out := map[int64]time.Time{}
	if exists {
		rows, err := q.QueryContext(ctx, "SELECT version_id, max(tstamp) FROM "+s.table+" WHERE version_id > 0 GROUP BY version_id")
		if err != nil {
			return nil, fmt.Errorf("migrations: read %s: %w", s.table, err)
		}
		defer rows.Close()
		for rows.Next() {
			var v int64
			var at time.Time
			if err := rows.Scan(&v, &at); err != nil {
				return nil, fmt.Errorf("migrations: read %s: %w", s.table, err)
			}
			out[v] = at
		}
		if err := rows.Err(); err != nil {
			return nil, fmt.Errorf("migrations: read %s: %w", s.table, err)
		}
		if len(out) > 0 {
			return out, nil
		}
	}
	k, err := s.legacyApplied(ctx, q)
	if err != nil {
		return nil, err
	}
	for _, lv := range s.legacy[:k] {
		out[lv.version] = time.Time{}
	}
	return out, nil
}

// status lists the migrations of s, each with whether and when it was applied. It only
// reads (see recorded).
func (s *set) status(ctx context.Context, q querier) ([]Migration, error) {
	steps, err := readSteps(s.files)
	if err != nil {
		return nil, err
	}
	applied, err := s.recorded(ctx, q)
	if err != nil {
		return nil, err
	}
	out := make([]Migration, 0, len(steps))
	for _, step := range steps {
		at, ok := applied[step.Version]
		out = append(out, Migration{Set: s.name, Step: step, Applied: ok, AppliedAt: at})
	}
	return out, nil
}
