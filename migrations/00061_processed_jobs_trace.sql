-- +goose Up
-- The trace id (32 hex digits) of the delivery whose claim holds or did the key's work,
-- NULL when that delivery was not traced: the ledger page links a row to its trace even
-- when the job was enqueued straight to asynq, with no intent. A claim writes it; only a
-- claim's own delivery can complete the row, so it is the completing delivery's too.
ALTER TABLE processed_jobs ADD COLUMN trace_id text;

-- +goose Down
ALTER TABLE processed_jobs DROP COLUMN trace_id;
