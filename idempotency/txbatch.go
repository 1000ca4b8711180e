package idempotency

// txBatcher runs concurrent DoTx deliveries in shared transactions, one savepoint each.
type txBatcher struct{}
