-- +goose Up
-- The periodic schedule every scheduler replica works from (idempotency/schedule): one row
-- per entry, upserted from a replica's entries at its start. revision grows when an
-- entry's spec changes (spec_sha256 tells), revised_at is when; a change applies from the
-- first tick after it. last_tick and last_key are the newest tick any replica enqueued
-- (its job's key), for catching up and for the overlap check. paused stops an entry's
-- ticks until it is resumed. A new table: its constraints are valid from the start.
CREATE TABLE schedule_entries (
    name         text        PRIMARY KEY CHECK (name ~ '^[a-z0-9_-]{1,64}$'),
    revision     bigint      NOT NULL DEFAULT 1 CHECK (revision >= 1),
    spec         jsonb       NOT NULL,
    spec_sha256  bytea       NOT NULL,
    paused       boolean     NOT NULL DEFAULT false,
    revised_at   timestamptz NOT NULL DEFAULT now(),
    last_tick    timestamptz NULL,
    last_key     text        NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE schedule_entries;
