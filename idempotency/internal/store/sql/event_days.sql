-- EventDaysSQL lists the partitions of processed_job_events (migration 00114), oldest
-- first: each one's name, the end of its range (read from its bound; the legacy
-- partition's starts at MINVALUE), whether a concurrent detach of it was left pending,
-- and the rows its statistics estimate (-1 before its first ANALYZE). No rows when the
-- table is not partitioned.
SELECT c.relname,
       substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \(''([^'']+)''\)')::timestamptz AS upper,
       i.inhdetachpending,
       c.reltuples::bigint
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass('processed_job_events')
ORDER BY upper
