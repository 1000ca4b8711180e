-- +goose Up
-- Which wallet entries each schedule entry's settlements (wallet:settle) have summed: an
-- entry stamped within a settled period whose transaction committed after the
-- settlement ran is summed by the next settlement of the same schedule entry instead of
-- never. A manual run's scope is its own key. A new table: older binaries neither read
-- nor write it (they settle by created_at alone, as before).
CREATE TABLE wallet_settled_entries (
    scope         text   NOT NULL,
    entry_id      bigint NOT NULL,
    settlement_id bigint NOT NULL,
    PRIMARY KEY (scope, entry_id)
);

-- +goose Down
DROP TABLE wallet_settled_entries;
