-- +goose Up
-- The recorded steps of leased jobs (idempotency.Step, idempotency.StepTx): one row per
-- key, generation and step name, written in the same transaction as a fenced update of
-- the job's processed_jobs row, so that only the claim holding the key records a step.
-- seq is the step's position in its run (0, 1, …): a later delivery that calls the steps
-- in another order is refused. result is the step's result as JSON; input_fingerprint,
-- when set, the fingerprint of the step's input (idempotency.StepInput). A re-run's new
-- generation deletes the older generations' rows; a purge deletes the key's rows with
-- its ledger row. A new table: its constraints are valid from the start.
CREATE TABLE processed_job_steps (
    idempotency_key   text        NOT NULL,
    generation        int         NOT NULL,
    step              text        NOT NULL CHECK (step ~ '^[a-z0-9_-]{1,64}$'),
    seq               int         NOT NULL CHECK (seq >= 0),
    fence             bigint      NOT NULL,
    input_fingerprint bytea       NULL,
    result            jsonb       NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (idempotency_key, generation, step)
);

-- +goose Down
DROP TABLE processed_job_steps;
