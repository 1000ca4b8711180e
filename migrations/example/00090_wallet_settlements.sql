-- +goose Up
-- The example's periodic settlement (wallet:settle): a row per settled tick, summing the
-- wallet entries of its period (period_start, period_end]. No unique constraint on the
-- tick's key, so a settlement that ran twice shows as two rows.
CREATE TABLE wallet_settlements (
    id             bigserial   PRIMARY KEY,
    settlement_key text        NOT NULL,
    period_start   timestamptz NOT NULL,
    period_end     timestamptz NOT NULL,
    entries        bigint      NOT NULL,
    total_cents    bigint      NOT NULL,
    fence          bigint      NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX wallet_settlements_key_idx ON wallet_settlements (settlement_key);
CREATE INDEX wallet_entries_created_at_idx ON wallet_entries (created_at);

-- +goose Down
DROP INDEX wallet_entries_created_at_idx;
DROP TABLE wallet_settlements;
