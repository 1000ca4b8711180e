package idempotency

// committer group-commits leased claims or completions.
type committer struct{}
