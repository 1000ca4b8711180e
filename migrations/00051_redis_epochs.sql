-- +goose Up
-- What the outbox last saw of each queue's Redis once a reconcile round had checked the
-- queue: the epoch marker kept in Redis (idemq:{<queue>}:epoch) and Redis's run_id. A
-- marker missing or different in Redis, or another run_id, tells any process, whenever it
-- started, that Redis may have lost the queue's tasks.
CREATE TABLE redis_epochs (
    queue        text        PRIMARY KEY,
    epoch        text        NOT NULL,
    -- '' until a reconciler has read Redis's run_id.
    redis_run_id text        NOT NULL DEFAULT '',
    updated_at   timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE redis_epochs;
