// Package schema is the ent schema of the example: one entity, Posting, on the postings
// table. `go generate ./ent/...` (from examples/ent) regenerates package ent from it.
package schema

import (
	"entgo.io/ent"
	"entgo.io/ent/schema/field"
)

// Posting is a row of postings: cents posted to an account under a reference.
type Posting struct {
	ent.Schema
}

// Fields of Posting; its id is ent's default, an int (postings.id, a bigserial).
func (Posting) Fields() []ent.Field {
	return []ent.Field{
		field.String("account").NotEmpty(),
		field.Int64("cents"),
		field.String("ref").NotEmpty(),
	}
}
