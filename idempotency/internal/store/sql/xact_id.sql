-- XactIDSQL reads a transaction's id and the server's start time, as XactID; send it
-- inside the transaction (it assigns the id), pipelined with the first statements.
SELECT pg_current_xact_id()::text, pg_postmaster_start_time()::text
