-- +goose Up
-- The completion ledger: one row per idempotency key, kept until retention purges it.

-- Fences come from one global sequence: a value is never handed out twice, even when the
-- transaction that drew it rolls back.
CREATE SEQUENCE processed_jobs_fence_seq AS bigint;

CREATE TABLE processed_jobs (
    idempotency_key text        PRIMARY KEY,
    task_type       text        NOT NULL,
    status          text        NOT NULL,
    fence           bigint      NOT NULL,
    owner           uuid,
    generation      int         NOT NULL DEFAULT 0,
    payload_sha256  bytea,
    result          jsonb,
    attempts        int         NOT NULL DEFAULT 0,
    last_error      text,
    locked_until    timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    -- When the current generation first ran: set by the first claim and by an operator
    -- re-run, kept by takeovers. The maximum age of an in-progress row counts from here.
    started_at      timestamptz NOT NULL DEFAULT now(),
    completed_at    timestamptz,

    -- 1..255 bytes of printable ASCII without spaces; idempotency.ValidateKey says the same.
    CONSTRAINT processed_jobs_key_check
        CHECK (octet_length(idempotency_key) BETWEEN 1 AND 255 AND idempotency_key ~ '^[!-~]+$'),
    CONSTRAINT processed_jobs_task_type_check
        CHECK (octet_length(task_type) BETWEEN 1 AND 255),
    CONSTRAINT processed_jobs_status_check
        CHECK (status IN ('in_progress', 'completed', 'failed', 'needs_attention')),
    CONSTRAINT processed_jobs_fence_check CHECK (fence > 0),
    CONSTRAINT processed_jobs_generation_check CHECK (generation >= 0),
    CONSTRAINT processed_jobs_attempts_check CHECK (attempts >= 0),
    CONSTRAINT processed_jobs_payload_sha256_check
        CHECK (payload_sha256 IS NULL OR octet_length(payload_sha256) = 32),
    -- A live claim always has an owner and a lease end.
    CONSTRAINT processed_jobs_lease_check
        CHECK (status <> 'in_progress' OR (owner IS NOT NULL AND locked_until IS NOT NULL)),
    -- Only terminal rows carry a completion time.
    CONSTRAINT processed_jobs_completed_at_check
        CHECK ((status IN ('completed', 'failed')) = (completed_at IS NOT NULL))
) WITH (fillfactor = 90);

-- One secondary index, on a column a completion does not change, so that completions,
-- heartbeats and takeovers are HOT updates (no new index entries; fillfactor leaves the
-- room on the page). It serves both age scans: the retention purge (a row completed before
-- a cutoff also started before it) and the search for rows in progress past the maximum
-- age.
CREATE INDEX processed_jobs_started_at_idx ON processed_jobs (started_at);

-- +goose Down
DROP TABLE processed_jobs;
DROP SEQUENCE processed_jobs_fence_seq;
