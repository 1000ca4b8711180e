-- DeleteEpoch's statement removes queue $1's epoch row, if it has one.
DELETE FROM redis_epochs WHERE queue = $1
