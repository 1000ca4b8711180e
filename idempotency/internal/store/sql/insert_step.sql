-- InsertStepSQL writes a step's row inside a transaction whose hold_step.sql matched.
INSERT INTO processed_job_steps (idempotency_key, generation, step, seq, fence, input_fingerprint, result)
VALUES ($1, $2, $3, $4, $5, $6, $7::text::jsonb) {{.StepConflict}}
