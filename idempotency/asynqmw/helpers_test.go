package asynqmw_test

import (
	"github.com/idemq/idemq/internal/testledger"
)

// Shared helpers, under the names these tests use.
var (
	newLedger = testledger.New
	get       = testledger.Get
	jsonEqual = testledger.JSONEqual
)
