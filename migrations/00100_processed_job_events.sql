-- +goose Up
-- The history of each key: the exceptional events of its deliveries (a duplicate answered
-- from the ledger, a mismatched payload refused, busy past its budget, a takeover with the
-- old and new fence, a lease lost, a self-fence, needs-attention, an operator's re-run, a
-- republish by the reconciler). Written best-effort by the process that saw the event, in
-- its next group-commit round: a crash may drop an event, never a job. At most 50 rows per
-- key and generation are kept; a purge deletes a key's rows with its ledger row; a re-run
-- keeps the older generations' rows (they are the story). No foreign key: an event may be
-- written for a key whose row another process has not committed yet, and the hot path
-- must not lock processed_jobs rows for it. A new table: its constraints are valid from
-- the start.
CREATE TABLE processed_job_events (
    -- The order of recording; unique by its sequence. No primary key: an append-only log
    -- read by key, and every index costs each recorded duplicate a WAL record.
    id              bigint      GENERATED ALWAYS AS IDENTITY,
    idempotency_key text        NOT NULL CHECK (octet_length(idempotency_key) BETWEEN 1 AND 255),
    generation      int         NOT NULL DEFAULT 0 CHECK (generation >= 0),
    at              timestamptz NOT NULL DEFAULT now(),
    -- duplicate | mismatch | busy | takeover | lease_lost | self_fence | needs_attention
    -- | rerun | republished (idempotency.Event* names them; new kinds may be added)
    kind            text        NOT NULL CHECK (kind ~ '^[a-z_]{1,32}$'),
    task_type       text        NULL,
    task_id         text        NULL,
    worker          text        NULL,   -- host/pid of the process that saw it
    fence           bigint      NULL,   -- the fence of the claim the event is about
    old_fence       bigint      NULL,   -- takeover: the fence taken over
    detail          text        NULL CHECK (octet_length(detail) <= 1024)
);

-- A key's history in order, and the per-key cap's count.
CREATE INDEX processed_job_events_key_idx ON processed_job_events (idempotency_key, id);
-- Counts per kind over a window (the ledger page). BRIN: events are appended roughly in
-- time order, and a BRIN index costs an insert next to nothing.
CREATE INDEX processed_job_events_at_idx ON processed_job_events USING brin (at);

-- +goose Down
DROP TABLE processed_job_events;
