// Package handlers is idemq's example domain: the business code of each task type, one
// file per type. It holds no retry, lock or ledger logic; the idempotency middleware wraps
// these functions.
//
// A handler reports a permanent failure (one no retry can fix, like a refused card) by
// wrapping asynq.SkipRetry; any other error is retried.
package handlers
