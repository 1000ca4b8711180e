-- +goose Up
-- The API's memory of Idempotency-Key headers (IETF httpapi idempotency-key draft): for
-- each route and header key, the fingerprint of the request body, the job it named and the
-- answer given. A row is written in the same transaction as the job's intent; while that
-- transaction is open, a repeat of the key gets 409.
CREATE TABLE api_idempotency_keys (
    route        text        NOT NULL,
    header_key   text        NOT NULL,
    fingerprint  bytea       NOT NULL,
    job_key      text        NOT NULL,
    task_type    text        NOT NULL,
    -- The answer to replay; NULL only inside the accepting transaction.
    status_code  int,
    response     bytea,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (route, header_key),
    CONSTRAINT api_idempotency_keys_header_key_check
        CHECK (octet_length(header_key) BETWEEN 1 AND 255 AND header_key ~ '^[ -~]+$'),
    CONSTRAINT api_idempotency_keys_fingerprint_check CHECK (octet_length(fingerprint) = 32)
);

-- GET /v1/jobs/{key} finds a job accepted under a header before a worker claims it.
CREATE INDEX api_idempotency_keys_job_key_idx ON api_idempotency_keys (job_key);
-- Old keys are purged by age.
CREATE INDEX api_idempotency_keys_created_at_idx ON api_idempotency_keys (created_at);

-- +goose Down
DROP TABLE api_idempotency_keys;
