-- cutoffSQL is the publish time before which a round with grace $1 ms checks intents, on
-- the database clock.
SELECT now() - $1::bigint * interval '1 millisecond'
