-- +goose Up
-- Validates processed_jobs_row_check (00070) on the rows written before it: a scan under
-- SHARE UPDATE EXCLUSIVE, which lets reads and writes go on. Nothing fails: those rows met
-- the constraints it replaced. A migration of its own, so that 00070's ACCESS EXCLUSIVE
-- lock is never held for a scan.
ALTER TABLE processed_jobs VALIDATE CONSTRAINT processed_jobs_row_check;

-- +goose Down
-- A validated constraint stays valid; 00070's Down replaces it.
