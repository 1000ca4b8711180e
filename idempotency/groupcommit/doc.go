// Package groupcommit shares transactions among concurrent callers, as the outbox's
// Enqueue does with its intents: each caller queues its request and waits, and a round
// sends whatever is queued in one transaction of the caller's own making (Config.Send).
// A round the server refuses because of one request is sent again in halves, down to
// that request. A COMMIT whose answer is lost (the connection broke after it was sent) is
// resolved by transaction id (Commit), so that a round is never reported as done when it
// did not commit, nor as failed when it did.
//
// The reference API's accept path (POST /v1/…) uses it to record its own rows with the
// outbox's intents (outbox.Client.EnqueueManyTx) in one transaction per round.
//
// Usage:
//
//	c := groupcommit.New(groupcommit.Config[order]{
//		Workers: 2, MaxBatch: 128, Timeout: 10 * time.Second,
//		Keys: func(o order) []string { return []string{o.ID} },
//		Send: func(ctx context.Context, round []order) error {
//			tx, err := pool.Begin(ctx)
//			if err != nil {
//				return err
//			}
//			defer tx.Rollback(context.WithoutCancel(ctx))
//			var id groupcommit.TxID
//			b := &pgx.Batch{}
//			b.Queue(groupcommit.TxIDSQL).QueryRow(func(r pgx.Row) error { return r.Scan(&id.Xid, &id.ServerStart) })
//			// ... queue the round's writes ...
//			if err := tx.SendBatch(ctx, b).Close(); err != nil {
//				return err
//			}
//			return groupcommit.Commit(ctx, tx, pool, id, 10*time.Second)
//		},
//		Refused: outbox.Refused, // a constraint or lock refused one row: split the round
//	})
//	err := c.Run(ctx, order{ID: "o-1", Cents: 500}) // from many goroutines at once
package groupcommit
