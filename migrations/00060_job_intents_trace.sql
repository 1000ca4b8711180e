-- +goose Up
-- The W3C traceparent of the request that recorded the intent (NULL when it was not
-- traced): the relay and the reconciler put it in every publish's task headers, so each
-- delivery's span joins the request's trace.
ALTER TABLE job_intents ADD COLUMN trace_parent text;

-- +goose Down
ALTER TABLE job_intents DROP COLUMN trace_parent;
