// Package schedule runs periodic jobs exactly once per tick, from any number of
// replicas.
//
// An Entry names a schedule (a cron expression in a time zone, or "@every D", which
// ticks at the multiples of D since the Unix epoch), a task type and a payload. Each
// tick becomes one job keyed TickKey(name, tick), cron:<name>:<tick in UTC>, recorded
// through the outbox: replicas that see the same tick record one intent, and a replica
// whose clock is off by seconds still names the same tick. A tick is due by the
// database's clock, read at each round, so that no replica enqueues one early. Replicas upsert their entries
// into the table schedule_entries (Sync, with a revision per change) and every replica
// schedules from that table, so they cannot disagree for longer than a round.
//
//	entries, err := schedule.ReadFile("schedule.yaml") // or []schedule.Entry{...}
//	if err != nil {
//		return err
//	}
//	s, err := schedule.New(pool, outboxClient, entries, &schedule.Config{Retention: retention})
//	if err != nil {
//		return err // names the entry and the field
//	}
//	return s.Run(ctx)
//
// Ticks missed while no replica ran are enqueued when one starts, per entry: CatchUpAll
// (the default: every missed tick within CatchUpWindow, 1h by default), CatchUpLatest or
// CatchUpNone. The window must be shorter than the ledger's retention: a tick's job is
// recognised as enqueued by its ledger row and intent, which retention purges. A paused
// entry (Pause) skips its ticks until Resume, without catching them up, even on a replica
// that starts after the Resume; OverlapSkip skips
// a tick while the previous tick's job is unfinished; RunNow enqueues a manual run, keyed
// ManualKey(name, id).
//
// A job is enqueued with the entry's revision that the replica read at the start of its
// round: a replica that read the old revision just before a change may enqueue the
// change's first tick with the old payload, and the others' attempts with the new one are
// then refused as a mismatch (EventMismatch, logged), never replayed silently. Entries a
// replica starts with replace the table's: roll a changed file out to every replica.
package schedule
