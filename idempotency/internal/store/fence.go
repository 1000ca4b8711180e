package store

// fenceChecks are the predicates with which a fenced write checks that its claim still
// holds the row: args for one row ($2 fence, $3 owner), rows for a batch (the row p
// joined to r, the batch's unnest).
type fenceChecks struct{ args, rows string }

var (
	// checkFence checks the fence and the owner: every write after a claim.
	checkFence = fenceChecks{args: `fence = $2 AND owner = $3`, rows: `p.fence = r.fence AND p.owner = r.owner`}
	// checkNothing keeps the parameters and checks nothing: the negative control's ledger
	// only (idempotency.Config.UnsafeNoFencing).
	checkNothing = fenceChecks{args: `$2::bigint > 0 AND $3::uuid IS NOT NULL`, rows: `r.fence > 0 AND r.owner IS NOT NULL`}
)

// Writes are the fenced writes, each built once with one set of fence checks.
type Writes struct {
	Heartbeat     string     // one claim's lease (it has no batch)
	FinishMany    *Statement // leased completions and failures
	FinishTxMany  string     // the rows of a shared transaction
	StoreResultTx string     // a DoTx result, on the row its claim wrote
}

func newWrites(f fenceChecks, name string) *Writes {
	return &Writes{
		Heartbeat:     heartbeatSQL(f),
		FinishMany:    &Statement{Name: name, SQL: finishManySQL(f)},
		FinishTxMany:  finishTxManySQL(f),
		StoreResultTx: storeResultTxSQL(f),
	}
}

var (
	// Fenced are the writes every ledger makes.
	Fenced = newWrites(checkFence, "idemq_finish_many")
	// Unfenced are the same writes checking nothing: for the negative control only.
	Unfenced = newWrites(checkNothing, "idemq_finish_many_nofence")
)
