-- +goose Up
-- No unique constraint on order_id: only idemq keeps a refund single.
CREATE TABLE refunds (
    id         bigserial PRIMARY KEY,
    order_id   text NOT NULL,
    cents      bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE refunds;
