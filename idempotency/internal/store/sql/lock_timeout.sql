-- Sets the transaction's lock_timeout to $1 (as "100ms"): a Part's own bound, and the
-- round's put back after it (Round).
SELECT set_config('lock_timeout', $1, true)
