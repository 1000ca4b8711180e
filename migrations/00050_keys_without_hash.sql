-- +goose Up
-- '#' is reserved in keys: republished tasks use TaskID key#r<n>, so a key that contained
-- "#r1" could name another key's republish. The constraints are added NOT VALID (old
-- finished rows may keep a '#'; nothing is rescanned), but a NOT VALID constraint is still
-- checked on every UPDATE, so a row that must still change (a claim in progress, a row
-- waiting for an operator, an intent not yet done) could never finish: refuse to migrate
-- while such a row exists, and say how many there are.
LOCK TABLE processed_jobs, job_intents IN SHARE MODE;

-- +goose StatementBegin
DO $$
DECLARE
    ledger_rows bigint;
    intent_rows bigint;
BEGIN
    SELECT count(*) INTO ledger_rows FROM processed_jobs
    WHERE status IN ('in_progress', 'needs_attention') AND strpos(idempotency_key, '#') > 0;
    SELECT count(*) INTO intent_rows FROM job_intents
    WHERE state IN ('pending', 'published') AND strpos(idempotency_key, '#') > 0;
    IF ledger_rows + intent_rows > 0 THEN
        RAISE EXCEPTION 'keys may no longer contain ''#'', but % unfinished processed_jobs rows and % unfinished job_intents rows have one', ledger_rows, intent_rows
            USING HINT = 'run the old version until those jobs finish (idemq ledger list --status needs_attention shows rows waiting for an operator), then migrate again';
    END IF;
END
$$;
-- +goose StatementEnd

ALTER TABLE processed_jobs ADD CONSTRAINT processed_jobs_key_no_hash_check
    CHECK (strpos(idempotency_key, '#') = 0) NOT VALID;
ALTER TABLE job_intents ADD CONSTRAINT job_intents_key_no_hash_check
    CHECK (strpos(idempotency_key, '#') = 0) NOT VALID;

-- +goose Down
ALTER TABLE job_intents DROP CONSTRAINT job_intents_key_no_hash_check;
ALTER TABLE processed_jobs DROP CONSTRAINT processed_jobs_key_no_hash_check;
