-- Epochs' statement reads every queue's epoch row, by queue.
SELECT queue, epoch, redis_run_id FROM redis_epochs ORDER BY queue
