-- XactStatusSQL learns whether c's transaction committed. While the server that assigned
-- the id runs, pg_xact_status answers exactly (and says "in progress" while a COMMIT is
-- still under way). After a restart the id may have been handed out again (its records
-- were never flushed), but no transaction from before the restart can still commit: the
-- row then shows for certain whether the fenced write landed.
SELECT CASE WHEN pg_postmaster_start_time()::text = $2 THEN pg_xact_status($1::text::xid8) END,
       pg_postmaster_start_time()::text = $2,
       EXISTS (SELECT 1 FROM processed_jobs
               WHERE idempotency_key = $3 AND fence = $4 AND owner = $5 AND status <> 'in_progress')
