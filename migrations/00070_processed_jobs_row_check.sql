-- +goose Up
-- processed_jobs' rules on its columns other than the key, in one CHECK instead of eight.
-- Each write prepares every CHECK of the table anew (it reads the stored expression trees
-- back from text: most of a single-row INSERT's server time), so what costs is the size of
-- those trees more than their number: the rules are the same, written shorter. A row that
-- breaks any of them is refused as before, now naming processed_jobs_row_check. The key's
-- two constraints keep their names: a bad key is told apart by them
-- (idempotency.ErrInvalidKey).
--
-- The rules, as 00001 wrote them one constraint each:
--   task_type: 1..255 bytes;  fence > 0;  generation >= 0;  attempts >= 0;
--   payload_sha256: NULL or 32 bytes (a CHECK passes when its expression is NULL);
--   status: in_progress (with an owner and a lease end), needs_attention, completed or
--   failed; completed_at is set exactly on the terminal statuses (completed, failed).
--
-- Added NOT VALID: nothing is scanned under this migration's ACCESS EXCLUSIVE lock, held
-- only for the catalog change. Every row already meets it (the constraints it replaces
-- were validated), it is enforced on every INSERT and UPDATE from now on, and 00071
-- validates it without blocking writes.
ALTER TABLE processed_jobs
    ADD CONSTRAINT processed_jobs_row_check CHECK (
        octet_length(task_type) <@ '[1,255]'::int4range
        AND fence > 0
        AND least(generation, attempts) >= 0
        AND octet_length(payload_sha256) = 32
        AND CASE status
            WHEN 'in_progress' THEN owner IS NOT NULL AND locked_until IS NOT NULL AND completed_at IS NULL
            WHEN 'needs_attention' THEN completed_at IS NULL
            ELSE status IN ('completed', 'failed') AND completed_at IS NOT NULL
        END
    ) NOT VALID,
    DROP CONSTRAINT processed_jobs_task_type_check,
    DROP CONSTRAINT processed_jobs_status_check,
    DROP CONSTRAINT processed_jobs_fence_check,
    DROP CONSTRAINT processed_jobs_generation_check,
    DROP CONSTRAINT processed_jobs_attempts_check,
    DROP CONSTRAINT processed_jobs_payload_sha256_check,
    DROP CONSTRAINT processed_jobs_lease_check,
    DROP CONSTRAINT processed_jobs_completed_at_check;

-- +goose Down
ALTER TABLE processed_jobs
    ADD CONSTRAINT processed_jobs_task_type_check
        CHECK (octet_length(task_type) BETWEEN 1 AND 255) NOT VALID,
    ADD CONSTRAINT processed_jobs_status_check
        CHECK (status IN ('in_progress', 'completed', 'failed', 'needs_attention')) NOT VALID,
    ADD CONSTRAINT processed_jobs_fence_check CHECK (fence > 0) NOT VALID,
    ADD CONSTRAINT processed_jobs_generation_check CHECK (generation >= 0) NOT VALID,
    ADD CONSTRAINT processed_jobs_attempts_check CHECK (attempts >= 0) NOT VALID,
    ADD CONSTRAINT processed_jobs_payload_sha256_check
        CHECK (payload_sha256 IS NULL OR octet_length(payload_sha256) = 32) NOT VALID,
    ADD CONSTRAINT processed_jobs_lease_check
        CHECK (status <> 'in_progress' OR (owner IS NOT NULL AND locked_until IS NOT NULL)) NOT VALID,
    ADD CONSTRAINT processed_jobs_completed_at_check
        CHECK ((status IN ('completed', 'failed')) = (completed_at IS NOT NULL)) NOT VALID,
    DROP CONSTRAINT processed_jobs_row_check;
ALTER TABLE processed_jobs
    VALIDATE CONSTRAINT processed_jobs_task_type_check,
    VALIDATE CONSTRAINT processed_jobs_status_check,
    VALIDATE CONSTRAINT processed_jobs_fence_check,
    VALIDATE CONSTRAINT processed_jobs_generation_check,
    VALIDATE CONSTRAINT processed_jobs_attempts_check,
    VALIDATE CONSTRAINT processed_jobs_payload_sha256_check,
    VALIDATE CONSTRAINT processed_jobs_lease_check,
    VALIDATE CONSTRAINT processed_jobs_completed_at_check;
