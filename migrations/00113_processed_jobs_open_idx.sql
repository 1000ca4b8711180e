-- +goose NO TRANSACTION
-- +goose Up
-- The rows still open, in progress or needing attention, by start: a handful beside the
-- completed and failed rows a ledger keeps for its retention. The retention round's
-- stuck-row sweep (mark_stuck.sql) and the needs-attention gauge (count.sql) read them
-- here instead of scanning the whole table. Its cost: a leased finish changes a row's
-- status, which this index's predicate reads, so that update is no longer HOT (it adds
-- entries to the primary key and started_at indexes); a transactional row is written
-- once, completed, and never enters it. Built CONCURRENTLY, so processed_jobs takes writes
-- meanwhile; an earlier attempt that failed halfway left an invalid index of this name,
-- dropped first.
DROP INDEX CONCURRENTLY IF EXISTS processed_jobs_open_idx;
CREATE INDEX CONCURRENTLY processed_jobs_open_idx ON processed_jobs (started_at) WHERE status IN ('in_progress', 'needs_attention');

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS processed_jobs_open_idx;
