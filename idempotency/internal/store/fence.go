package store

// fenceChecks are the predicates with which a fenced write checks that its claim still
// holds the row: args for one row ($2 fence, $3 owner), rows for a batch (the row p
// joined to r, the batch's unnest); and those of a DoTx transaction: hold takes a key's
// advisory lock (k.key) if it is free and holdWait waits for it, conflict is the
// insert's answer to a row there since the read, takeover re-checks, on the newest version of a row that is there, what the read found
// (p, the row; r, the member's), and guard fails the finish unless it wrote every
// member's row (w.n rows written of r's); stepConflict ends a step row's insert (none: a
// second record of a step is a unique_violation).
type fenceChecks struct{ args, rows, hold, holdWait, conflict, takeover, guard, stepConflict string }

var (
	// checkFence checks the fence and the owner: every write after a claim.
	checkFence = fenceChecks{
		args: `fence = $2 AND owner = $3`, rows: `p.fence = r.fence AND p.owner = r.owner`,
		hold:     `pg_try_advisory_xact_lock(` + keyLockID + `)`,
		holdWait: `pg_advisory_xact_lock(` + keyLockID + `)::text = ''`,
		conflict: `/* a row there since the read: unique_violation */`,
		takeover: `p.status = 'in_progress' AND p.locked_until < now()
	  AND p.attempts = r.attempt - 1 AND p.generation = r.generation
	  AND (p.payload_sha256 IS NULL OR r.fp IS NULL OR p.payload_sha256 = r.fp)`,
		guard: `1 / (CASE WHEN w.n = (SELECT count(*) FROM r) THEN 1 ELSE 0 END)`,
	}
	// checkNothing keeps the parameters and checks nothing: the negative control's ledger
	// only (idempotency.Config.UnsafeNoFencing).
	checkNothing = fenceChecks{
		args: `$2::bigint > 0 AND $3::uuid IS NOT NULL`, rows: `r.fence > 0 AND r.owner IS NOT NULL`,
		hold: `k.key IS NOT NULL`, holdWait: `k.key <> ''`,
		conflict: `ON CONFLICT (idempotency_key) DO UPDATE SET status = excluded.status, fence = excluded.fence,
	  owner = excluded.owner, result = excluded.result, attempts = excluded.attempts, completed_at = excluded.completed_at`,
		takeover: `p.idempotency_key IS NOT NULL`, guard: `w.n AS unguarded`,
		stepConflict: `ON CONFLICT (idempotency_key, generation, step) DO UPDATE SET seq = excluded.seq,
	  fence = excluded.fence, input_fingerprint = excluded.input_fingerprint, result = excluded.result`,
	}
)

// Writes are the fenced writes, each built once with one set of fence checks.
type Writes struct {
	Heartbeat     string     // one claim's lease (Ledger.Heartbeat)
	HeartbeatMany string     // the leases of every Do handler of a process
	FinishMany    *Statement // leased completions and failures
	HoldKeys      string     // a DoTx transaction's keys, held when free
	HoldKeyWait   string     // a lone DoTx transaction's key, waited for
	FinishTx      string     // the rows of a DoTx transaction, written

	RecordStepSQL string // a step's row under its fenced row lock, one statement
	HoldStepSQL   string // the fenced row lock that opens a StepTx transaction
	InsertStepSQL string // a StepTx's step row
}

func newWrites(f fenceChecks, name string) *Writes {
	return &Writes{
		Heartbeat:     heartbeatSQL(f),
		HeartbeatMany: heartbeatManySQL(f),
		FinishMany:    &Statement{Name: name, SQL: finishManySQL(f)},
		HoldKeys:      holdKeysSQL(f, false),
		HoldKeyWait:   holdKeysSQL(f, true),
		FinishTx:      finishTxSQL(f),

		RecordStepSQL: recordStepSQL(f),
		HoldStepSQL:   holdStepSQL(f),
		InsertStepSQL: insertStepSQL(f),
	}
}

var (
	// Fenced are the writes every ledger makes.
	Fenced = newWrites(checkFence, "idemq_finish_many")
	// Unfenced are the same writes checking nothing: for the negative control only.
	Unfenced = newWrites(checkNothing, "idemq_finish_many_nofence")
)
