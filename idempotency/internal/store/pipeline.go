package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// Part is one statement of a round: a batch of rows of one kind.
type Part struct {
	Stmt *Statement
	Args []any
	// Rows is how many rows the batch carries: an answer's ordinal is 1..Rows.
	Rows int
	// Read scans an answered row, whose ordinal (already read) is ord.
	Read func(ord int, rows pgx.Rows) error
	// Optional marks a part the round may do without: its failure wraps ErrOptionalPart.
	Optional bool
	// LockTimeout, if set, bounds this part's lock waits instead of RoundOptions'
	// (as "100ms"): the round sets it before the part and puts the round's back after it.
	LockTimeout string
}

// lockTimeoutSQL sets the transaction's lock_timeout to $1 (lock_timeout.sql).
var lockTimeoutSQL = sqlText("lock_timeout", nil)

// ErrOptionalPart is wrapped by the error of a round that failed at an Optional part.
var ErrOptionalPart = errors.New("an optional statement of the round failed")

// RoundOptions say how Round sends.
type RoundOptions struct {
	// Prepared sends the statements as named prepared statements (once per connection),
	// as pgx does under its default exec mode; otherwise they go unnamed.
	Prepared bool
	// LockTimeout bounds the waits for another session's row lock, as "2000ms".
	LockTimeout string
	// ReadFirst reads every answer before the commit is asked for, so that the
	// transaction id the rows carry (Finished) is known should the commit's answer be
	// lost; otherwise the commit is asked for with the statements, one round trip.
	ReadFirst bool
}

// Round sends parts in one implicit transaction of the extended protocol on conn, after
// the claims' settings (claimSettingsSQL), and commits it with the Sync that ends it: the
// statements and the commit cost one round trip (two with ReadFirst: the statements are
// sent with a Flush, which makes the server answer but keeps the transaction open). An
// error the server answered means nothing committed; lost reports a commit that was
// asked for and whose answer was lost, its outcome unknown.
func Round(ctx context.Context, conn *pgx.Conn, opt RoundOptions, parts []Part) (lost bool, err error) {
	m := conn.TypeMap()
	type stmt struct {
		sd     *pgconn.StatementDescription // nil: sent unnamed
		oids   []uint32
		params [][]byte
	}
	stmts := make([]stmt, len(parts))
	for i, p := range parts {
		var s stmt
		if opt.Prepared && p.Stmt.ParamOIDs == nil {
			if s.sd, err = conn.Prepare(ctx, p.Stmt.Name, p.Stmt.SQL); s.sd != nil { // once per connection
				s.oids = s.sd.ParamOIDs
			}
		} else {
			s.oids, err = p.Stmt.paramTypes(ctx, conn.PgConn())
		}
		if err != nil && p.Optional {
			return false, fmt.Errorf("%w: %w", ErrOptionalPart, err)
		}
		if err != nil {
			return false, err
		}
		s.params = make([][]byte, len(p.Args))
		for j, a := range p.Args {
			if s.params[j], err = m.Encode(s.oids[j], pgtype.BinaryFormatCode, a, nil); err != nil {
				return false, fmt.Errorf("argument %d: %w", j+1, err)
			}
		}
		stmts[i] = s
	}

	pc := conn.PgConn()
	pipe := pc.StartPipeline(ctx)
	defer pipe.Close()
	pipe.SendQueryParams(claimSettingsSQL, [][]byte{[]byte(opt.LockTimeout)}, nil, nil, nil)
	for i, s := range stmts {
		if parts[i].LockTimeout != "" {
			pipe.SendQueryParams(lockTimeoutSQL, [][]byte{[]byte(parts[i].LockTimeout)}, nil, nil, nil)
		}
		formats := make([]int16, len(s.params))
		for j := range formats {
			formats[j] = pgtype.BinaryFormatCode
		}
		if s.sd != nil {
			pipe.SendQueryStatement(s.sd, s.params, formats, nil) // text results
		} else {
			pipe.SendQueryParams(parts[i].Stmt.SQL, s.params, s.oids, formats, nil)
		}
		if parts[i].LockTimeout != "" {
			pipe.SendQueryParams(lockTimeoutSQL, [][]byte{[]byte(opt.LockTimeout)}, nil, nil, nil)
		}
	}
	if opt.ReadFirst {
		pipe.SendFlushRequest()
		err = pipe.Flush()
	} else {
		err = pipe.Sync()
	}
	if err != nil {
		return false, err
	}
	// Ends (rolls back) a transaction left open by a failure before the commit was asked
	// for; Close reads the answer.
	abort := func() {
		if opt.ReadFirst && !pc.IsClosed() {
			pipe.Sync()
		}
	}
	var res any
	if res, err = pipe.GetResults(); err == nil { // the settings
		if rr, ok := res.(*pgconn.ResultReader); ok {
			_, err = rr.Close()
		} else {
			err = fmt.Errorf("unexpected pipeline result %T", res)
		}
	}
	if err != nil {
		abort()
		return false, err
	}
	for _, p := range parts {
		err := error(nil)
		if p.LockTimeout != "" {
			err = closeResult(pipe)
		}
		if err == nil {
			err = readPart(pipe, m, p)
		}
		if err == nil && p.LockTimeout != "" {
			err = closeResult(pipe)
		}
		if err != nil {
			abort()
			if p.Optional {
				err = fmt.Errorf("%w: %w", ErrOptionalPart, err)
			}
			return false, err
		}
	}
	if opt.ReadFirst {
		err = pipe.Sync()
	}
	if err == nil {
		res, err = pipe.GetResults()
		if _, ok := res.(*pgconn.PipelineSync); err == nil && !ok {
			err = fmt.Errorf("unexpected pipeline result %T", res)
		}
	}
	if err != nil {
		var pgErr *pgconn.PgError
		return !errors.As(err, &pgErr), err // answered: not committed
	}
	return false, nil
}

// nextResult reads the next statement's answer from pipe.
func nextResult(pipe *pgconn.Pipeline) (*pgconn.ResultReader, error) {
	res, err := pipe.GetResults()
	if err != nil {
		return nil, err
	}
	rr, ok := res.(*pgconn.ResultReader)
	if !ok {
		return nil, fmt.Errorf("unexpected pipeline result %T", res)
	}
	return rr, nil
}

// readPart hands each answered row of p to p.Read with its ordinal (1-based).
func readPart(pipe *pgconn.Pipeline, m *pgtype.Map, p Part) error {
	rr, err := nextResult(pipe)
	if err != nil {
		return err
	}
	rows := pgx.RowsFromResultReader(m, rr)
	defer rows.Close()
	for rows.Next() {
		ord, err := strconv.Atoi(string(rows.RawValues()[0]))
		if err != nil || ord < 1 || ord > p.Rows {
			return fmt.Errorf("answer for row %q of %d", rows.RawValues()[0], p.Rows)
		}
		if err := p.Read(ord, rows); err != nil {
			return err
		}
	}
	rows.Close()
	return rows.Err()
}
