-- Notify's statement: a notification with an empty payload on channel $1.
SELECT pg_notify($1, '')
