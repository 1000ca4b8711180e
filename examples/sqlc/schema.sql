-- The postings table, as internal/posting.Schema creates it; sqlc reads it to type the
-- queries. No unique constraint on ref: only the ledger keeps a posting single.
CREATE TABLE IF NOT EXISTS postings (
	id      bigserial PRIMARY KEY,
	account text   NOT NULL,
	cents   bigint NOT NULL,
	ref     text   NOT NULL
);
