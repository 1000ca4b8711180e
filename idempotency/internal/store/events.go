package store

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A key's history: the exceptional events of its deliveries, in processed_job_events.
// The hot path never waits for them: they ride a statement of a round already going to
// Postgres (InsertEvents as one more Part, or queued in a DoTx finish), or are written by
// a background flush.

// MaxEventsPerGeneration caps the events kept per key, generation and day (UTC, the
// table's partitions): an insert past it is skipped.
const MaxEventsPerGeneration = 50

// MaxEventDetail caps an event's detail, in bytes (the table's CHECK).
const MaxEventDetail = 1024

// EventParams is one event to record. Zero Fence, OldFence and empty strings are NULL.
type EventParams struct {
	Key        string
	Generation int
	At         time.Time
	Kind       string
	TaskType   string
	TaskID     string
	Worker     string
	Fence      int64
	OldFence   int64
	Detail     string
}

// Worker names this process in events: host/pid.
var Worker = func() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	return fmt.Sprintf("%s/%d", host, os.Getpid())
}()

// insertEventsSQL records a batch of events, within MaxEventsPerGeneration
// (insert_events.sql).
var insertEventsSQL = sqlText("insert_events", nil)

// EventsLockTimeout bounds how long an events statement waits for a lock on
// processed_job_events (VACUUM FULL, a migration's ALTER, a partition being attached):
// past it the statement fails and its events are counted lost, so that a finish never
// waits on the history.
const EventsLockTimeout = "100ms"

// eventsSettingsSQL starts the events' own transaction (events_settings.sql).
var eventsSettingsSQL = sqlText("events_settings", map[string]string{"EventsLockTimeout": EventsLockTimeout})

// InsertEvents is the events statement, a Part of a round or sent alone. Its parameter
// types are fixed: it is never prepared nor described, as that would take the table's
// lock outside any lock_timeout (see Statement).
var InsertEvents = &Statement{Name: "idemq_insert_events", SQL: insertEventsSQL, ParamOIDs: []uint32{
	pgtype.TextArrayOID, pgtype.Int4ArrayOID, pgtype.TimestamptzArrayOID, pgtype.TextArrayOID, pgtype.TextArrayOID,
	pgtype.TextArrayOID, pgtype.TextArrayOID, pgtype.Int8ArrayOID, pgtype.Int8ArrayOID, pgtype.TextArrayOID,
	pgtype.TimestamptzOID, pgtype.TimestamptzOID}}

// EventArgs returns InsertEvents' arguments for es.
func EventArgs(es []EventParams) []any {
	n := len(es)
	keys, gens, ats, kinds := make([]string, n), make([]int32, n), make([]time.Time, n), make([]string, n)
	types, ids, workers, details := make([]pgtype.Text, n), make([]pgtype.Text, n), make([]pgtype.Text, n), make([]pgtype.Text, n)
	fences, olds := make([]pgtype.Int8, n), make([]pgtype.Int8, n)
	var first, last time.Time // the days the events fall in, for the cap's count
	for i, e := range es {
		keys[i], gens[i], ats[i], kinds[i] = cleanText(e.Key, 255), int32(max(e.Generation, 0)), e.At, e.Kind
		if ats[i].IsZero() {
			ats[i] = time.Now()
		}
		if i == 0 || ats[i].Before(first) {
			first = ats[i]
		}
		if i == 0 || ats[i].After(last) {
			last = ats[i]
		}
		types[i], ids[i], workers[i] = optText(e.TaskType, 255), optText(e.TaskID, 255), optText(e.Worker, 255)
		details[i] = optText(e.Detail, MaxEventDetail)
		fences[i] = pgtype.Int8{Int64: e.Fence, Valid: e.Fence != 0}
		olds[i] = pgtype.Int8{Int64: e.OldFence, Valid: e.OldFence != 0}
	}
	const day = 24 * time.Hour
	return []any{keys, gens, ats, kinds, types, ids, workers, fences, olds, details,
		first.UTC().Truncate(day), last.UTC().Truncate(day).Add(day)}
}

// EventsPart is InsertEvents for es as a Part of a Round: it answers no rows.
func EventsPart(es []EventParams) Part {
	return Part{Stmt: InsertEvents, Args: EventArgs(es), Rows: len(es), Read: func(int, pgx.Rows) error { return nil }, Optional: true,
		LockTimeout: EventsLockTimeout}
}

// WriteEvents records es in a transaction of their own on a connection of pool, which
// waits at most EventsLockTimeout for the table's lock (see eventsSettingsSQL).
func WriteEvents(ctx context.Context, pool *pgxpool.Pool, es []EventParams) error {
	if len(es) == 0 {
		return nil
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	pipe := conn.Conn().PgConn().StartPipeline(ctx)
	defer pipe.Close()
	if err := queueEvents(pipe, conn.Conn().TypeMap(), es); err != nil {
		return err
	}
	if err := pipe.Sync(); err != nil {
		return err
	}
	return readEvents(pipe)
}

// queueEvents queues es's own transaction on pipe: its settings (eventsSettingsSQL) and
// InsertEvents, sent unnamed with their fixed types; a Sync must follow.
func queueEvents(pipe *pgconn.Pipeline, m *pgtype.Map, es []EventParams) error {
	params, formats, err := encodeArgs(m, InsertEvents.ParamOIDs, EventArgs(es))
	if err != nil {
		return err
	}
	pipe.SendQueryParams(eventsSettingsSQL, nil, nil, nil, nil)
	pipe.SendQueryParams(insertEventsSQL, params, InsertEvents.ParamOIDs, formats, nil)
	return nil
}

// readEvents reads the answers to queueEvents's statements and the Sync after them, and
// returns the first error.
func readEvents(pipe *pgconn.Pipeline) error {
	var first error
	for range 2 {
		if err := closeResult(pipe); err != nil && first == nil {
			first = err
		}
	}
	if _, err := pipe.GetResults(); err != nil && first == nil { // the Sync
		first = err
	}
	return first
}

// closeResult reads one statement's answer from pipe and returns its error.
func closeResult(pipe *pgconn.Pipeline) error {
	rr, err := nextResult(pipe)
	if err != nil {
		return err
	}
	_, err = rr.Close()
	return err
}

// encodeArgs encodes args in the binary format for the parameter types oids.
func encodeArgs(m *pgtype.Map, oids []uint32, args []any) ([][]byte, []int16, error) {
	params, err := encode(m, pgtype.BinaryFormatCode, oids, args)
	if err != nil {
		return nil, nil, err
	}
	formats := make([]int16, len(args))
	for j := range formats {
		formats[j] = pgtype.BinaryFormatCode
	}
	return params, formats, nil
}

// encode encodes args in format for the parameter types oids.
func encode(m *pgtype.Map, format int16, oids []uint32, args []any) ([][]byte, error) {
	params := make([][]byte, len(args))
	for j, a := range args {
		var err error
		if params[j], err = m.Encode(oids[j], format, a, nil); err != nil {
			return nil, fmt.Errorf("argument %d: %w", j+1, err)
		}
	}
	return params, nil
}

// cleanText makes s a value Postgres text takes (valid UTF-8, no NUL), of at most limit
// bytes, cut at a character's start.
func cleanText(s string, limit int) string {
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "?")
	}
	if strings.IndexByte(s, 0) >= 0 {
		s = strings.ReplaceAll(s, "\x00", "?")
	}
	if len(s) > limit {
		cut := limit
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut]
	}
	return s
}

func optText(s string, limit int) pgtype.Text {
	return pgtype.Text{String: cleanText(s, limit), Valid: s != ""}
}

// EventRow is a recorded event.
type EventRow struct {
	ID         int64
	Generation int
	At         time.Time
	Kind       string
	TaskType   string
	TaskID     string
	Worker     string
	Fence      int64 // 0: none
	OldFence   int64 // 0: none
	Detail     string
}

// keyEventsSQL reads a key's newest events, in the order they happened (key_events.sql).
var keyEventsSQL = sqlText("key_events", nil)

// KeyEvents returns key's newest limit events, in the order they happened.
func KeyEvents(ctx context.Context, q DB, key string, limit int) ([]EventRow, error) {
	rows, err := q.Query(ctx, keyEventsSQL, key, limit)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (EventRow, error) {
		var e EventRow
		var gen int32
		err := row.Scan(&e.ID, &gen, &e.At, &e.Kind, &e.TaskType, &e.TaskID, &e.Worker, &e.Fence, &e.OldFence, &e.Detail)
		e.Generation = int(gen)
		return e, err
	})
}
