package store

// The operators' statements (idempotency's Get, List, Release, Rerun, Purge, MarkStuck)
// and the lost-commit resolution, each in the sql/ file named after it.
var (
	// GetSQL reads a key's row as a record (get.sql).
	GetSQL = sqlText("get", nil)
	// GetManySQL reads the rows of the keys in $1 (get_many.sql).
	GetManySQL = sqlText("get_many", nil)
	// ListSQL lists the newest rows, of one status or of any (list.sql).
	ListSQL = sqlText("list", nil)
	// CountSQL counts the rows with status $1 (count.sql).
	CountSQL = sqlText("count", nil)
	// ReleaseSQL ends a lease and fences its holder out (release.sql).
	ReleaseSQL = sqlText("release", nil)
	// RerunSQL reopens a row as a new generation, with its outbox intent (rerun.sql).
	RerunSQL = sqlText("rerun", nil)
	// PurgeSQL deletes one batch of old terminal rows, with what hangs on them (purge.sql).
	PurgeSQL = sqlText("purge", nil)
	// MarkStuckSQL turns the expired, too old claims into needs_attention (mark_stuck.sql).
	MarkStuckSQL = sqlText("mark_stuck", nil)
	// XactStatusSQL learns whether a finish's transaction committed (xact_status.sql).
	XactStatusSQL = sqlText("xact_status", nil)
	// PurgeDeadIntentsSQL deletes one batch of old dead intents without a ledger row
	// (purge_dead_intents.sql).
	PurgeDeadIntentsSQL = sqlText("purge_dead_intents", nil)
	// PurgeBacklogSQL counts, up to a cap, what the two purges would still delete
	// (purge_backlog.sql).
	PurgeBacklogSQL = sqlText("purge_backlog", nil)
)
