-- +goose Up
-- The stand-in payment provider (`idemq fakepay`): every request it receives, and every
-- charge it creates.
CREATE TABLE fakepay_requests (
    id              bigserial   PRIMARY KEY,
    idempotency_key text,
    order_id        text,
    body            jsonb,
    status_code     int         NOT NULL,
    charge_id       text,
    replayed        boolean     NOT NULL DEFAULT false,
    received_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX fakepay_requests_key_idx ON fakepay_requests (idempotency_key);

CREATE TABLE fakepay_charges (
    id              text        PRIMARY KEY,
    idempotency_key text,
    order_id        text        NOT NULL,
    customer_id     text        NOT NULL,
    amount_cents    bigint      NOT NULL,
    currency        text        NOT NULL,
    -- Whether the provider honoured keys when it made this charge; only those charges
    -- hold their key exclusively.
    honored         boolean     NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX fakepay_charges_idempotency_key_key
    ON fakepay_charges (idempotency_key) WHERE honored;
CREATE INDEX fakepay_charges_order_idx ON fakepay_charges (order_id);

-- +goose Down
DROP TABLE fakepay_charges;
DROP TABLE fakepay_requests;
