package idempotency

// fenceChecks are the predicates with which a fenced write checks that its claim still
// holds the row: args for one row ($2 fence, $3 owner), rows for a batch (the row p
// joined to r, the batch's unnest).
type fenceChecks struct{ args, rows string }

var (
	// checkFence checks the fence and the owner: every write after a claim.
	checkFence = fenceChecks{args: `fence = $2 AND owner = $3`, rows: `p.fence = r.fence AND p.owner = r.owner`}
	// checkNothing keeps the parameters and checks nothing: Config.UnsafeNoFencing, the
	// negative control's ledger, only.
	checkNothing = fenceChecks{args: `$2::bigint > 0 AND $3::uuid IS NOT NULL`, rows: `r.fence > 0 AND r.owner IS NOT NULL`}
)

// fencedSQL are the ledger's fenced writes, each built once with the ledger's fence
// checks: one set of statements, whatever the checks.
type fencedSQL struct {
	heartbeat, complete, failRetry, failPermanent string // one row
	finishMany, finishTxMany                      string // a batch
	storeResultTx                                 string // a DoTx result, one row
}

func newFencedSQL(f fenceChecks) *fencedSQL {
	return &fencedSQL{
		heartbeat:     heartbeatSQL(f),
		complete:      completeSQL(f),
		failRetry:     failRetrySQL(f),
		failPermanent: failPermanentSQL(f),
		finishMany:    finishManySQL(f),
		finishTxMany:  finishTxManySQL(f),
		storeResultTx: storeResultTxSQL(f),
	}
}

var (
	fencedWrites   = newFencedSQL(checkFence)
	unfencedWrites = newFencedSQL(checkNothing)
)
