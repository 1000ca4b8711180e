package idempotency

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/internal/localserver"
	"github.com/idemq/idemq/internal/testenv"
)

// xactClaim runs a transaction that draws an id and ends it with end ("COMMIT",
// "ROLLBACK" or "" to leave it open), and returns a claim carrying that id.
func xactClaim(t *testing.T, l *Ledger, end string) *Claim {
	t.Helper()
	ctx := testenv.Context(t, time.Minute)
	tx, err := l.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c := &Claim{Key: "x", Fence: 1, TaskType: "t", owner: pgtype.UUID{Valid: true}}
	if err := tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text, pg_postmaster_start_time()::text`).Scan(&c.xid, &c.serverStart); err != nil {
		t.Fatal(err)
	}
	switch end {
	case "COMMIT":
		err = tx.Commit(ctx)
	case "ROLLBACK":
		err = tx.Rollback(ctx)
	default:
		t.Cleanup(func() { tx.Rollback(context.Background()) })
	}
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestResolveLostCommit(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	l := New(pool, nil)
	defer l.Close()
	ctx := testenv.Context(t, time.Minute)
	lost := io.ErrUnexpectedEOF // what a dropped connection looks like

	if err := l.commitLost(ctx, xactClaim(t, l, "COMMIT"), lost); err != nil {
		t.Fatalf("committed transaction: %v, want nil", err)
	}
	if err := l.commitLost(ctx, xactClaim(t, l, "ROLLBACK"), lost); err == nil || !strings.Contains(err.Error(), "aborted") {
		t.Fatalf("aborted transaction: %v, want an aborted error", err)
	}
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if err := l.commitLost(short, xactClaim(t, l, ""), lost); !errors.Is(err, ErrCommitUnknown) {
		t.Fatalf("transaction still in progress: %v, want ErrCommitUnknown", err)
	}
	// The server answered: the transaction did not commit, no resolution needed.
	if err := l.commitLost(ctx, xactClaim(t, l, "COMMIT"), &pgconn.PgError{Code: "57P01"}); err == nil {
		t.Fatal("commit refused by the server: nil error")
	}

	// After a restart the id may have been reused: the fenced row decides.
	c := xactClaim(t, l, "COMMIT")
	c.serverStart = "1970-01-01 00:00:00+00"
	if ok, err := l.resolveXact(ctx, c); err != nil || ok {
		t.Fatalf("restarted server, no row: %t, %v; want not committed", ok, err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, completed_at)
		VALUES ('x', 't', 'completed', 1, $1, now())`, c.owner); err != nil {
		t.Fatal(err)
	}
	if ok, err := l.resolveXact(ctx, c); err != nil || !ok {
		t.Fatalf("restarted server, completed row: %t, %v; want committed", ok, err)
	}

	// An id the server cannot tell about.
	c = xactClaim(t, l, "COMMIT")
	c.xid = "0"
	if _, err := l.resolveXact(ctx, c); err == nil {
		t.Fatal("invalid transaction id: nil error")
	}
}

func TestDecideRaces(t *testing.T) {
	t.Parallel()
	l := &Ledger{cfg: Config{MaxAge: time.Hour}, log: slog.New(slog.DiscardHandler)}
	req := Request{Key: "k", TaskType: "t"}
	var r store.ClaimRow // no row visible, yet the insert did not take it
	if _, _, again, err := l.decide(context.Background(), req, &Claim{}, &r, 0); !again || err != nil {
		t.Fatalf("first race: again=%t err=%v, want another round", again, err)
	}
	if _, _, again, err := l.decide(context.Background(), req, &Claim{}, &r, maxClaimRounds-1); again || !errors.Is(err, ErrBusy) {
		t.Fatalf("last race: again=%t err=%v, want ErrBusy", again, err)
	}
}

func TestCleanText(t *testing.T) {
	t.Parallel()
	got := cleanText("a\x00b\xffc")
	if got != "a\\x00b\uFFFDc" {
		t.Fatalf("cleanText = %q", got)
	}
	long := cleanText(strings.Repeat("é", maxLastErrorBytes))
	if len(long) > maxLastErrorBytes+len("…") || !strings.HasSuffix(long, "…") || !strings.HasPrefix(long, "é") {
		t.Fatalf("cleanText of a long string: %d bytes", len(long))
	}
	if errors.Unwrap(Permanent(io.EOF)) != io.EOF {
		t.Fatal("Permanent does not unwrap")
	}
}

func TestOperatorErrorsOnClosedPool(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	l := New(pool, nil)
	defer l.Close()
	pool.Close()
	ctx := testenv.Context(t, time.Minute)
	checks := map[string]error{}
	_, checks["Get"] = l.Get(ctx, "k")
	_, checks["List"] = l.List(ctx, "", 1)
	checks["Release"] = l.Release(ctx, "k")
	_, checks["Rerun"] = l.Rerun(ctx, "k")
	_, checks["Purge"] = l.Purge(ctx, time.Hour, 1)
	_, checks["MarkStuck"] = l.MarkStuck(ctx)
	_, checks["Claim"] = l.Claim(ctx, Request{Key: "k", TaskType: "t"})
	_, checks["DoTx"] = l.DoTx(ctx, Request{Key: "k", TaskType: "t"}, nil)
	c := &Claim{Key: "k", TaskType: "t"}
	checks["Complete"] = l.Complete(ctx, c, nil)
	checks["Fail"] = l.Fail(ctx, c, nil)
	for name, err := range checks {
		if err == nil || !strings.HasPrefix(err.Error(), "idempotency: ") {
			t.Errorf("%s on a closed pool: %v, want an idempotency error", name, err)
		}
	}
	l.markStuckOne(ctx, Request{Key: "k", TaskType: "t"}, 1) // logs, does not panic
}

// TestResolveAcrossPromotion: a COMMIT whose answer was lost when the primary died is
// resolved on the promoted standby by the fenced row, never by its transaction id, which
// the new primary may already have handed to another transaction. One write reached the
// standby before the crash (committed), one did not (an asynchronous standby's lost
// window: not committed), and the new primary's first transaction takes the lost one's
// id and commits.
func TestResolveAcrossPromotion(t *testing.T) {
	if testing.Short() {
		t.Skip("starts two Postgres servers")
	}
	t.Parallel()
	ctx := testenv.Context(t, 2*time.Minute)
	primary, standby := testenv.StartPair(t, false)
	if err := testenv.Migrate(ctx, primary.URL); err != nil {
		t.Fatal(err)
	}
	pool := testenv.Pool(t, localserver.MultiHostURL(primary, standby))
	onStandby := testenv.Pool(t, standby.URL)
	l := New(pool, nil)
	defer l.Close()

	// write commits a completed row for key in a transaction of its own and returns the
	// claim that made it, carrying the transaction's id.
	write := func(key string) *Claim {
		t.Helper()
		c := &Claim{Key: key, Fence: 1, TaskType: "t", owner: pgtype.UUID{Bytes: [16]byte{1}, Valid: true}}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if err := tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text, pg_postmaster_start_time()::text`).Scan(&c.xid, &c.serverStart); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, completed_at)
			VALUES ($1, 't', 'completed', 1, $2, now())`, key, c.owner); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		return c
	}
	kept := write("kept")
	for testenv.Count(t, onStandby, `SELECT count(*) FROM processed_jobs WHERE idempotency_key = 'kept'`) == 0 {
		time.Sleep(10 * time.Millisecond)
	}
	if err := primary.HoldWAL(); err != nil { // the standby hears no more
		t.Fatal(err)
	}
	lost := write("lost")
	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := standby.Promote(); err != nil {
		t.Fatal(err)
	}

	// The new primary's first transaction: the id the lost one had, or the next.
	var reused string
	for {
		err := func() error {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(ctx)
			if err := tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(&reused); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("no transaction on the promoted standby: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	var status string
	if err := pool.QueryRow(ctx, `SELECT coalesce(pg_xact_status($1::text::xid8), 'unknown')`, lost.xid).Scan(&status); err != nil {
		t.Fatal(err)
	}
	t.Logf("lost transaction %s; the promoted standby's first transaction %s; pg_xact_status(%s) there: %s", lost.xid, reused, lost.xid, status)
	if reused != lost.xid || status != "committed" {
		t.Fatalf("the promoted standby did not hand the lost id to its first transaction (%s, %s): the case this test is for did not happen", reused, status)
	}

	if ok, err := l.resolveXact(ctx, kept); err != nil || !ok {
		t.Errorf("the write the standby received: committed %t, %v; want committed", ok, err)
	}
	if ok, err := l.resolveXact(ctx, lost); err != nil || ok {
		t.Errorf("the write the standby never received (its id now %s on the new primary): committed %t, %v; want not committed", status, ok, err)
	}
}
