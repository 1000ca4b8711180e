-- +goose Up
-- The outbox: every accepted job's intent, recorded in the accepting transaction, so a job
-- the web app was told is accepted survives a Redis that loses its queues.
CREATE TABLE job_intents (
    idempotency_key    text        PRIMARY KEY,
    task_type          text        NOT NULL,
    payload            bytea       NOT NULL,
    payload_sha256     bytea       NOT NULL,
    queue              text        NOT NULL,
    max_retry          int         NOT NULL,
    timeout_ms         bigint      NOT NULL,
    retention_ms       bigint      NOT NULL,
    -- pending → published → done | dead
    state              text        NOT NULL DEFAULT 'pending',
    -- 0 publishes under TaskID = key; n > 0 under key#r<n> (a republish).
    publish_generation int         NOT NULL DEFAULT 0,
    -- A relay that took the intent to publish holds it until then.
    relay_until        timestamptz,
    last_error         text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    published_at       timestamptz,
    finished_at        timestamptz,
    updated_at         timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT job_intents_key_check
        CHECK (octet_length(idempotency_key) BETWEEN 1 AND 255 AND idempotency_key ~ '^[!-~]+$'),
    CONSTRAINT job_intents_state_check CHECK (state IN ('pending', 'published', 'done', 'dead')),
    CONSTRAINT job_intents_payload_sha256_check CHECK (octet_length(payload_sha256) = 32),
    CONSTRAINT job_intents_published_check CHECK (state = 'pending' OR published_at IS NOT NULL OR state IN ('done', 'dead'))
);

CREATE INDEX job_intents_pending_idx ON job_intents (created_at) WHERE state = 'pending';
CREATE INDEX job_intents_published_idx ON job_intents (published_at) WHERE state = 'published';

-- +goose Down
DROP TABLE job_intents;
