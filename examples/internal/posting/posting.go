// Package posting is the job every example runs: cents posted to an account, once per
// reference. Each example writes the posting's row with its own ORM, inside the
// transaction idemq hands its handler.
package posting

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/hibiken/asynq"
)

// TaskType is the job's asynq task type.
const TaskType = "ledger:posting"

// Posting is the job's payload.
type Posting struct {
	Account string `json:"account"`
	Cents   int64  `json:"cents"`
	Ref     string `json:"ref"`
}

// Key is the ledger key: one posting per reference, however often it is delivered.
func (p Posting) Key() string { return "posting:" + p.Ref }

// LockScope serialises the postings of one account across workers.
func (p Posting) LockScope() string { return "account:" + p.Account }

// Validate refuses a payload without an account or a reference (server.Decode calls it).
func (p Posting) Validate() error {
	if p.Account == "" || p.Ref == "" {
		return errors.New("posting: account and ref are required")
	}
	return nil
}

// NewTask is the posting's task.
func NewTask(p Posting) (*asynq.Task, error) {
	payload, err := json.Marshal(p)
	if err != nil {
		return nil, err
	}
	return asynq.NewTask(TaskType, payload), nil
}

// Schema creates the table the examples write. There is no unique constraint on ref: only
// the ledger keeps a posting single, which is what the examples' tests check.
const Schema = `CREATE TABLE IF NOT EXISTS postings (
	id      bigserial PRIMARY KEY,
	account text   NOT NULL,
	cents   bigint NOT NULL,
	ref     text   NOT NULL
)`

// Result is a handler's answer, stored in the ledger and answered to every duplicate.
func Result(id int64) json.RawMessage {
	return json.RawMessage(fmt.Sprintf(`{"posting_id":%d}`, id))
}
