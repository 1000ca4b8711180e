-- +goose Up
-- The wallet:debit example's effect. There is deliberately no unique constraint on
-- reference: the ledger alone keeps each debit single.
CREATE TABLE wallet_entries (
    id           bigserial   PRIMARY KEY,
    account_id   text        NOT NULL,
    amount_cents bigint      NOT NULL,
    reference    text        NOT NULL,
    fence        bigint      NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX wallet_entries_reference_idx ON wallet_entries (reference);
CREATE INDEX wallet_entries_account_idx ON wallet_entries (account_id);

-- +goose Down
DROP TABLE wallet_entries;
