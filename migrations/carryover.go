package migrations

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"

	"github.com/pressly/goose/v3/database"
	"github.com/pressly/goose/v3/lock"
)

// A legacyVersion is a migration an older idemq applied and recorded in goose's default
// table, goose_db_version, and the object it left in the schema.
//
// The versions to carry over are read from the schema's objects, never from
// goose_db_version: that table may also hold an application's own versions, under the
// same numbers as idemq's (an application's version 1 made an older idemq skip its own
// version 1), so a row there does not say that idemq's migration ran, and a schema whose
// objects an older idemq did create is the one thing that does.
type legacyVersion struct {
	version int64
	object  string // for messages: "table processed_jobs"
	exists  string // SQL: true when the object is in the current schema
}

var coreLegacy = []legacyVersion{
	legacyTable(1, "processed_jobs"),
	legacyTable(20, "job_intents"),
	legacyTable(40, "api_idempotency_keys"),
	legacyConstraint(50, "processed_jobs", "processed_jobs_key_no_hash_check"),
	legacyTable(51, "redis_epochs"),
	legacyColumn(60, "job_intents", "trace_parent"),
	legacyColumn(61, "processed_jobs", "trace_id"),
}

var exampleLegacy = []legacyVersion{
	legacyTable(10, "fakepay_requests"),
	legacyTable(11, "wallet_entries"),
}

// relation is the SQL naming table in the current schema only (a table of the same name
// later in search_path is not this schema's).
func relation(table string) string {
	return fmt.Sprintf("to_regclass(quote_ident(current_schema()) || '.%s')", table)
}

func legacyTable(v int64, table string) legacyVersion {
	return legacyVersion{v, "table " + table, relation(table) + " IS NOT NULL"}
}

func legacyColumn(v int64, table, column string) legacyVersion {
	return legacyVersion{v, "column " + table + "." + column, fmt.Sprintf(
		"EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = %s AND attname = '%s' AND NOT attisdropped)",
		relation(table), column)}
}

func legacyConstraint(v int64, table, name string) legacyVersion {
	return legacyVersion{v, "constraint " + name, fmt.Sprintf(
		"EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = %s AND conname = '%s')", relation(table), name)}
}

// carryOverLocker takes idemq's migration lock and, holding it, carries the schema over
// before goose reads the version table: two migrators never carry over at once.
type carryOverLocker struct {
	lock.SessionLocker
	set *set
}

func (l carryOverLocker) SessionLock(ctx context.Context, conn *sql.Conn) error {
	if err := l.SessionLocker.SessionLock(ctx, conn); err != nil {
		return err
	}
	if err := l.set.carryOver(ctx, conn); err != nil {
		// goose closes the connection without unlocking when locking fails.
		return errors.Join(err, l.SessionLocker.SessionUnlock(context.WithoutCancel(ctx), conn))
	}
	return nil
}

// carryOver records in the set's version table the versions an older idemq applied, when
// the table holds no version yet (it is missing, or a status check made it empty).
//
// The set's legacy objects decide: none of them means a schema idemq never migrated (its
// first migration, processed_jobs or fakepay_requests, is absent), and nothing is
// recorded; the objects of the first k versions, and no later one, mean that those k ran (an
// older idemq applied them in order); any other mix is refused, naming what is there and
// what is missing, since nothing says which migrations ran (a table of an application's
// that happens to share a name, or a migration an older idemq left half done).
// goose_db_version is neither read nor written.
func (s *set) carryOver(ctx context.Context, conn *sql.Conn) error {
	store, err := database.NewStore(database.DialectPostgres, s.table)
	if err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	err = s.carryOverTx(ctx, conn, store)
	if errors.Is(err, errCreateVersionTable) {
		// Only a check of pending versions creates the version table without the lock: if
		// it did so at the same moment, the second attempt finds the table.
		if exists, _ := s.tableExists(ctx, conn); exists {
			err = s.carryOverTx(ctx, conn, store)
		}
	}
	return err
}

var errCreateVersionTable = errors.New("migrations: carry over: create the version table")

func (s *set) carryOverTx(ctx context.Context, conn *sql.Conn, store database.Store) error {
	exists, err := s.tableExists(ctx, conn)
	if err != nil {
		return fmt.Errorf("migrations: carry over: %w", err)
	}
	if exists {
		var recorded bool
		q := "SELECT EXISTS (SELECT 1 FROM " + s.table + " WHERE version_id > 0)"
		if err := conn.QueryRowContext(ctx, q).Scan(&recorded); err != nil {
			return fmt.Errorf("migrations: carry over: %w", err)
		}
		if recorded {
			return nil
		}
	}

	k, err := s.legacyApplied(ctx, conn)
	if err != nil {
		return err
	}
	if k == 0 {
		return nil
	}

	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("migrations: carry over: %w", err)
	}
	defer tx.Rollback()
	if !exists {
		// As goose creates it: the table, then version 0.
		if err := store.CreateVersionTable(ctx, tx); err != nil {
			return fmt.Errorf("%w: %w", errCreateVersionTable, err)
		}
		if err := store.Insert(ctx, tx, database.InsertRequest{Version: 0}); err != nil {
			return fmt.Errorf("migrations: carry over: %w", err)
		}
	}
	for _, lv := range s.legacy[:k] {
		if err := store.Insert(ctx, tx, database.InsertRequest{Version: lv.version}); err != nil {
			return fmt.Errorf("migrations: carry over: %w", err)
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("migrations: carry over: %w", err)
	}
	return nil
}

// legacyApplied returns how many of the set's legacy versions an older idemq applied, read
// from the schema's objects (see carryOver), or the refusal of a mix that is not the
// objects of migrations applied in order. It only reads.
func (s *set) legacyApplied(ctx context.Context, q querier) (int, error) {
	present, err := s.legacyPresent(ctx, q)
	if err != nil {
		return 0, err
	}
	k, last := 0, -1
	for k < len(present) && present[k] {
		k++
	}
	for i, ok := range present {
		if ok {
			last = i
		}
	}
	if last >= k {
		var there, missing []string
		for i, lv := range s.legacy[:last+1] {
			if present[i] {
				there = append(there, fmt.Sprintf("%s (version %d)", lv.object, lv.version))
			} else {
				missing = append(missing, fmt.Sprintf("%s (version %d)", lv.object, lv.version))
			}
		}
		return 0, fmt.Errorf("migrations: the schema holds %s of idemq's %s migrations, but not %s: "+
			"not the objects of migrations applied in order, so which of them ran is unknown; "+
			"rename those tables if they are not idemq's, or drop them if an older idemq left its migration half done, then migrate again",
			strings.Join(there, ", "), s.name, strings.Join(missing, ", "))
	}
	return k, nil
}

// legacyPresent reports, for each of the set's legacy versions, whether its object is in
// the current schema, in one query.
func (s *set) legacyPresent(ctx context.Context, q querier) ([]bool, error) {
	cols := make([]string, len(s.legacy))
	for i, lv := range s.legacy {
		cols[i] = lv.exists
	}
	present := make([]bool, len(s.legacy))
	dest := make([]any, len(present))
	for i := range present {
		dest[i] = &present[i]
	}
	if err := q.QueryRowContext(ctx, "SELECT "+strings.Join(cols, ", ")).Scan(dest...); err != nil {
		return nil, fmt.Errorf("migrations: carry over: read the schema's objects: %w", err)
	}
	return present, nil
}

// tableExists reports whether the set's version table is in the current schema, where
// goose looks for it.
func (s *set) tableExists(ctx context.Context, q querier) (bool, error) {
	var exists bool
	err := q.QueryRowContext(ctx, "SELECT "+relation(s.table)+" IS NOT NULL").Scan(&exists)
	return exists, err
}
