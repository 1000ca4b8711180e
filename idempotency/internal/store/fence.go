package store

// fenceChecks are the predicates with which a fenced write checks that its claim still
// holds the row, each the value of a placeholder of the write's .sql file ({{.Args}} and
// so on): Args for one row ($2 fence, $3 owner), Rows for a batch (the row p joined to r,
// the batch's unnest); and those of a DoTx transaction: Hold takes a key's advisory lock
// (k.key) if it is free and HoldWait waits for it, Conflict is the insert's answer to a
// row there since the read, Takeover re-checks, on the newest version of a row that is
// there, what the read found (p, the row; r, the member's), and Guard fails the finish
// unless it wrote every member's row (w.n rows written of r's); StepConflict ends a step
// row's insert (none: a second record of a step is a unique_violation).
type fenceChecks struct{ Args, Rows, Hold, HoldWait, Conflict, Takeover, Guard, StepConflict string }

// keyLockSeed seeds the hash of a key's advisory lock (hashtextextended), so that the
// ledger's locks do not meet those of an application hashing its own strings unseeded;
// the seed is mixed with the ledger table's oid, so that ledgers in other schemas of the
// database do not meet either.
const keyLockSeed = `7309475139880105073`

// keyLockID is the advisory lock id of key k.key.
const keyLockID = `hashtextextended(k.key, ` + keyLockSeed + ` # 'processed_jobs'::regclass::oid::bigint)`

var (
	// checkFence checks the fence and the owner: every write after a claim.
	checkFence = fenceChecks{
		Args: `fence = $2 AND owner = $3`, Rows: `p.fence = r.fence AND p.owner = r.owner`,
		Hold:     `pg_try_advisory_xact_lock(` + keyLockID + `)`,
		HoldWait: `pg_advisory_xact_lock(` + keyLockID + `)::text = ''`,
		Conflict: `/* a row there since the read: unique_violation */`,
		Takeover: `p.status = 'in_progress' AND p.locked_until < now()
	  AND p.attempts = r.attempt - 1 AND p.generation = r.generation
	  AND (p.payload_sha256 IS NULL OR r.fp IS NULL OR p.payload_sha256 = r.fp)`,
		Guard: `1 / (CASE WHEN w.n = (SELECT count(*) FROM r) THEN 1 ELSE 0 END)`,
	}
	// checkNothing keeps the parameters and checks nothing: the negative control's ledger
	// only (idempotency.Config.UnsafeNoFencing).
	checkNothing = fenceChecks{
		Args: `$2::bigint > 0 AND $3::uuid IS NOT NULL`, Rows: `r.fence > 0 AND r.owner IS NOT NULL`,
		Hold: `k.key IS NOT NULL`, HoldWait: `k.key <> ''`,
		Conflict: `ON CONFLICT (idempotency_key) DO UPDATE SET status = excluded.status, fence = excluded.fence,
	  owner = excluded.owner, result = excluded.result, attempts = excluded.attempts, completed_at = excluded.completed_at`,
		Takeover: `p.idempotency_key IS NOT NULL`, Guard: `w.n AS unguarded`,
		StepConflict: `ON CONFLICT (idempotency_key, generation, step) DO UPDATE SET seq = excluded.seq,
	  fence = excluded.fence, input_fingerprint = excluded.input_fingerprint, result = excluded.result`,
	}
)

// Writes are the fenced writes, each built once with one set of fence checks.
type Writes struct {
	Heartbeat     string     // one claim's lease (Ledger.Heartbeat): heartbeat.sql
	HeartbeatMany string     // the leases of every Do handler of a process: heartbeat_many.sql
	FinishMany    *Statement // leased completions and failures: finish_many.sql
	HoldKeys      string     // a DoTx transaction's keys, held when free: hold_keys.sql
	HoldKeyWait   string     // a lone DoTx transaction's key, waited for: hold_keys.sql
	FinishTx      string     // the rows of a DoTx transaction, written: finish_tx.sql

	RecordStepSQL string // a step's row under its fenced row lock, one statement: record_step.sql
	HoldStepSQL   string // the fenced row lock that opens a StepTx transaction: hold_step.sql
	InsertStepSQL string // a StepTx's step row: insert_step.sql
}

// heldKeys fills hold_keys.sql: with Wait, a key's lock is waited for (HoldWait).
type heldKeys struct {
	fenceChecks
	Wait bool
}

// newWrites renders each fenced write's file with the checks f.
func newWrites(f fenceChecks, name string) *Writes {
	return &Writes{
		Heartbeat:     sqlText("heartbeat", f),
		HeartbeatMany: sqlText("heartbeat_many", f),
		FinishMany:    &Statement{Name: name, SQL: sqlText("finish_many", f)},
		HoldKeys:      sqlText("hold_keys", heldKeys{f, false}),
		HoldKeyWait:   sqlText("hold_keys", heldKeys{f, true}),
		FinishTx:      sqlText("finish_tx", f),

		RecordStepSQL: sqlText("record_step", f),
		HoldStepSQL:   sqlText("hold_step", f),
		InsertStepSQL: sqlText("insert_step", f),
	}
}

var (
	// Fenced are the writes every ledger makes.
	Fenced = newWrites(checkFence, "idemq_finish_many")
	// Unfenced are the same writes checking nothing: for the negative control only.
	Unfenced = newWrites(checkNothing, "idemq_finish_many_nofence")
)
