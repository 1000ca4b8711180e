package idempotency

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/idempotency/internal/commit"
	"github.com/idemq/idemq/idempotency/internal/store"
)

// The lanes of the leased committer, in the order a round sends them: the completions and
// failures first, then the claims.
const (
	laneFinish = iota
	laneClaim
)

// The attributes of a group-committed round's span: how many claims and how many
// completions or failures it carried.
const (
	attrClaims      = attribute.Key("idemq.claims")
	attrCompletions = attribute.Key("idemq.completions")
)

// leasedOp is one caller's row in the leased committer: a claim or a finish, and what the
// round answered for it.
type leasedOp struct {
	key    string
	claim  *store.ClaimParams  // a claim, or
	finish *store.FinishParams // a completion or failure
	span   trace.Span          // its caller's (idemq.claim or idemq.complete), nil for none

	answered bool           // a row came back for it
	row      store.ClaimRow // a claim's answer
	finished store.Finished // a finish's answer: its transaction
	lost     bool           // the commit was asked for and its answer lost
}

// newLeasedCommitter returns the committer of leased claims and finishes. By default
// concurrent callers share rounds: each round sends every lane's rows as one multi-row
// statement per lane, in one transaction, so that the fixed cost of a statement (parsing,
// planning, the round trips) and of a commit (its WAL flush) is paid once per round
// instead of once per row. Each row keeps its own checks (fence, owner, lease), so each
// caller gets its own row's outcome. Config.DisableGroupCommit sends each row alone, on
// its caller's goroutine, as a batch of one.
func (l *Ledger) newLeasedCommitter() *commit.Committer[*leasedOp] {
	return commit.New(commit.Config[*leasedOp]{
		Lanes:     2,
		Workers:   l.cfg.Committers,
		MaxBatch:  l.cfg.MaxBatch,
		Inline:    l.cfg.DisableGroupCommit,
		Timeout:   l.cfg.WriteTimeout,
		Key:       func(op *leasedOp) string { return op.key },
		Send:      l.sendLeased,
		Refused:   store.Answered,
		Retryable: pgconn.SafeToRetry,
		Observe: func(lane, n int) {
			if lane == laneClaim {
				l.observeBatch(BatchClaim, n)
			} else {
				l.observeBatch(BatchComplete, n)
			}
		},
	})
}

// sendLeased sends one round of the leased committer in one transaction of its own (see
// store.Round): the finishes, whose transaction id is read before the commit is asked
// for, and the claims. A round that two or more traced callers share is a span of its
// own, "idemq.commit" (see commit.StartSpan).
func (l *Ledger) sendLeased(ctx context.Context, batches [][]*leasedOp) (err error) {
	var parts []store.Part
	var traced commit.SpanMembers
	for lane, b := range batches {
		for _, op := range b {
			op.answered, op.lost = false, false
			traced.Add(op.span)
		}
		if len(b) == 0 {
			continue
		}
		part := store.Part{Rows: len(b)}
		if lane == laneFinish {
			ps := make([]store.FinishParams, len(b))
			for i, op := range b {
				ps[i] = *op.finish
			}
			part.Stmt, part.Args = l.writes.FinishMany, store.FinishArgs(ps)
			part.Read = func(ord int, rows pgx.Rows) error {
				b[ord-1].answered = true
				return store.ScanFinished(rows, &b[ord-1].finished)
			}
		} else {
			ps := make([]store.ClaimParams, len(b))
			for i, op := range b {
				ps[i] = *op.claim
			}
			part.Stmt, part.Args = store.ClaimMany, store.ClaimArgs(ps, l.cfg.MaxAge)
			part.Read = func(ord int, rows pgx.Rows) error {
				b[ord-1].answered = true
				return store.ScanClaim(rows, &b[ord-1].row)
			}
		}
		parts = append(parts, part)
	}
	if span := commit.StartSpan(l.tracer, "idemq.commit", len(batches[laneClaim])+len(batches[laneFinish]), traced,
		attrClaims.Int(len(batches[laneClaim])), attrCompletions.Int(len(batches[laneFinish]))); span != nil {
		defer func() { commit.EndSpan(span, err) }()
	}
	conn, err := l.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("idempotency: commit: %w", err)
	}
	defer conn.Release()
	opt := store.RoundOptions{Prepared: l.prepare, LockTimeout: l.lockTimeoutSQL, ReadFirst: len(batches[laneFinish]) > 0}
	// Keys' history events ride the round, as its first statement: no round trip of their
	// own. Should the round be refused for them, it is sent again without them, so that
	// they never decide a claim's or a finish's outcome (see history.refused).
	events := l.hist.take()
	lost, err := store.Round(ctx, conn.Conn(), opt, l.hist.parts(events, parts))
	if events != nil && errors.Is(err, store.ErrOptionalPart) && !lost && store.Answered(err) {
		l.hist.refused(events, err)
		events = nil
		for _, b := range batches {
			for _, op := range b {
				op.answered = false
			}
		}
		lost, err = store.Round(ctx, conn.Conn(), opt, parts)
	}
	if events != nil && err != nil && !lost && (store.Answered(err) || pgconn.SafeToRetry(err)) {
		// Refused for another statement, or never sent: they were not written.
		l.hist.giveBack(events, false)
		events = nil
	}
	l.hist.done(events, err)
	if lost {
		for _, b := range batches {
			for _, op := range b {
				op.lost = true
			}
		}
	}
	if err != nil {
		return fmt.Errorf("idempotency: commit: %w", err)
	}
	return nil
}
