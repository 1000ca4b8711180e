package outbox_test

import (
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/internal/testledger"
)

// Shared helpers, under the names these tests use.
var (
	newLedger = testledger.New
	mustExec  = testenv.Exec
	count     = testenv.Count
)
