-- +goose Up
-- The example's checkout (order:checkout): a row per recorded order, with no unique
-- constraint on the order, so a step that ran twice shows as two rows; and every request
-- the stand-in provider's email endpoint received, which never honours Idempotency-Key
-- (a provider without idempotency), so a receipt sent twice shows as two rows.
CREATE TABLE orders (
    id           bigserial   PRIMARY KEY,
    order_id     text        NOT NULL,
    customer_id  text        NOT NULL,
    amount_cents bigint      NOT NULL,
    currency     text        NOT NULL,
    charge_id    text,
    fence        bigint,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX orders_order_id_idx ON orders (order_id);

CREATE TABLE fakepay_emails (
    id              bigserial   PRIMARY KEY,
    order_id        text        NOT NULL,
    to_address      text        NOT NULL,
    subject         text        NOT NULL,
    idempotency_key text,
    fence           bigint,
    received_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX fakepay_emails_order_id_idx ON fakepay_emails (order_id);

-- +goose Down
DROP TABLE fakepay_emails;
DROP TABLE orders;
