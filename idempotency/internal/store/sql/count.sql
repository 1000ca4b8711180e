-- CountSQL counts the rows with status $1: in_progress and needs_attention from
-- processed_jobs_open_idx (migration 00113), completed and failed by a scan of the table.
SELECT count(*) FROM processed_jobs WHERE status = $1
