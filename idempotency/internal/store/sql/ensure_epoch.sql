-- EnsureEpoch's statement records queue $1's row with marker $2, unless it has one.
INSERT INTO redis_epochs (queue, epoch) VALUES ($1, $2) ON CONFLICT (queue) DO NOTHING
