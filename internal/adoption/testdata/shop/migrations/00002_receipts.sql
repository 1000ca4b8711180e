-- +goose Up
-- The stand-in email provider's records: one receipt per idempotency key, and how many
-- times it was asked for.
CREATE TABLE receipts (
    idempotency_key text PRIMARY KEY,
    order_id        text NOT NULL,
    email           text NOT NULL,
    calls           int NOT NULL DEFAULT 1
);

-- +goose Down
DROP TABLE receipts;
