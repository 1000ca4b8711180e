-- ResolveXact's statement: the fate of transaction $1 when the server is still the run that
-- started at $2 (NULL: another server, or an id it no longer knows).
SELECT CASE WHEN pg_postmaster_start_time()::text = $2 THEN pg_xact_status($1::text::xid8)::text END,
	pg_postmaster_start_time()::text = $2
