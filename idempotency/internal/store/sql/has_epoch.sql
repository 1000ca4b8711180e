-- HasEpoch's statement: whether queue $1 has an epoch row.
SELECT EXISTS (SELECT 1 FROM redis_epochs WHERE queue = $1)
