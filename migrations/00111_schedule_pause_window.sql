-- +goose Up
-- The last pause of each periodic entry (idempotency/schedule): paused_at is when it was
-- paused (set when an active entry is paused), resumed_at when it was resumed (set when a
-- paused entry is resumed). A replica that starts after the resume, or comes back from a
-- partition, skips the ticks in [paused_at, resumed_at] instead of catching them up; a
-- NULL paused_at with a resumed_at (paused by an older binary) skips every tick before
-- the resume. Nullable columns without defaults: older binaries neither read nor write
-- them, and their pause and resume work as before.
ALTER TABLE schedule_entries ADD COLUMN paused_at timestamptz NULL;
ALTER TABLE schedule_entries ADD COLUMN resumed_at timestamptz NULL;

-- +goose Down
ALTER TABLE schedule_entries DROP COLUMN resumed_at;
ALTER TABLE schedule_entries DROP COLUMN paused_at;
