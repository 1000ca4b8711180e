-- +goose NO TRANSACTION
-- +goose Up
-- Dead intents whose key has no ledger row (a payload the decoder refused, a task archived
-- before any claim) are purged by the retention window as rows are; this index finds them
-- by age in bounded batches. Built CONCURRENTLY, so job_intents takes writes meanwhile; an
-- earlier attempt that failed halfway left an invalid index of this name, dropped first.
DROP INDEX CONCURRENTLY IF EXISTS job_intents_dead_idx;
CREATE INDEX CONCURRENTLY job_intents_dead_idx ON job_intents (finished_at) WHERE state = 'dead';

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS job_intents_dead_idx;
