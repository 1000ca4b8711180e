-- +goose NO TRANSACTION
-- +goose Up
-- Each key's history, processed_job_events, becomes a table partitioned by day on `at`,
-- so that retention drops a day of events at once (idempotency's retention round detaches
-- and drops partitions past the window, and creates them ahead) instead of deleting them
-- row by row with their key. The table keeps its name, columns and indexes: the binaries
-- of the release before write into it, read it and delete from it as before.
--
-- The existing table becomes the first partition, processed_job_events_legacy, holding
-- every event before a bound two days after today (UTC); daily partitions follow it. It is
-- attached without a scan under ACCESS EXCLUSIVE: a CHECK (at < bound) is added NOT VALID
-- (a moment's lock) and validated first (a scan that takes writes meanwhile), which proves
-- the partition's range. Three statements, each its own transaction; run again after a
-- failure, each starts over from where the schema is.

-- +goose StatementBegin
DO $$
DECLARE
	bound timestamptz := date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' + interval '2 days';
BEGIN
	IF (SELECT relkind FROM pg_class WHERE oid = 'processed_job_events'::regclass) = 'p' THEN
		RETURN;
	END IF;
	ALTER TABLE processed_job_events DROP CONSTRAINT IF EXISTS processed_job_events_legacy_bound;
	EXECUTE format('ALTER TABLE processed_job_events ADD CONSTRAINT processed_job_events_legacy_bound CHECK (at < %L) NOT VALID', bound);
	-- The partition bound, for the third statement; the first attempt of a rerun sets it anew.
	EXECUTE format('COMMENT ON CONSTRAINT processed_job_events_legacy_bound ON processed_job_events IS %L', bound);
END $$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $$
BEGIN
	IF (SELECT relkind FROM pg_class WHERE oid = 'processed_job_events'::regclass) = 'p' THEN
		RETURN;
	END IF;
	ALTER TABLE processed_job_events VALIDATE CONSTRAINT processed_job_events_legacy_bound;
END $$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $$
DECLARE
	bound timestamptz;
	last bigint;
	called boolean;
	day timestamptz;
BEGIN
	IF (SELECT relkind FROM pg_class WHERE oid = 'processed_job_events'::regclass) = 'p' THEN
		RETURN;
	END IF;
	LOCK TABLE processed_job_events IN ACCESS EXCLUSIVE MODE;
	SELECT obj_description(oid, 'pg_constraint')::timestamptz INTO bound FROM pg_constraint
	WHERE conrelid = 'processed_job_events'::regclass AND conname = 'processed_job_events_legacy_bound' AND convalidated;
	IF bound IS NULL OR bound < now() + interval '1 hour' THEN
		RAISE EXCEPTION 'processed_job_events: the legacy bound % is missing or about to pass; run the migration again', bound;
	END IF;

	ALTER TABLE processed_job_events RENAME TO processed_job_events_legacy;
	ALTER INDEX processed_job_events_key_idx RENAME TO processed_job_events_legacy_key_idx;
	ALTER INDEX processed_job_events_at_idx RENAME TO processed_job_events_legacy_at_idx;
	-- A partition may not have an identity of its own: the ids continue from a sequence of
	-- the same name, owned by the partitioned table's column.
	SELECT s.last_value, s.is_called INTO last, called FROM processed_job_events_id_seq s;
	ALTER TABLE processed_job_events_legacy ALTER COLUMN id DROP IDENTITY;
	CREATE SEQUENCE processed_job_events_id_seq AS bigint;
	PERFORM setval('processed_job_events_id_seq', last, called);

	-- The columns and checks of 00100, in its order, the checks under the names the legacy
	-- table's got (a partition must carry each of them); `at` is the partition key.
	CREATE TABLE processed_job_events (
		id              bigint      NOT NULL DEFAULT nextval('processed_job_events_id_seq'),
		idempotency_key text        NOT NULL CONSTRAINT processed_job_events_idempotency_key_check
		                                     CHECK (octet_length(idempotency_key) BETWEEN 1 AND 255),
		generation      int         NOT NULL DEFAULT 0 CONSTRAINT processed_job_events_generation_check CHECK (generation >= 0),
		at              timestamptz NOT NULL DEFAULT now(),
		kind            text        NOT NULL CONSTRAINT processed_job_events_kind_check CHECK (kind ~ '^[a-z_]{1,32}$'),
		task_type       text        NULL,
		task_id         text        NULL,
		worker          text        NULL,
		fence           bigint      NULL,
		old_fence       bigint      NULL,
		detail          text        NULL CONSTRAINT processed_job_events_detail_check CHECK (octet_length(detail) <= 1024)
	) PARTITION BY RANGE (at);
	ALTER SEQUENCE processed_job_events_id_seq OWNED BY processed_job_events.id;
	CREATE INDEX processed_job_events_key_idx ON processed_job_events (idempotency_key, id);
	CREATE INDEX processed_job_events_at_idx ON processed_job_events USING brin (at);
	-- The validated bound proves the range, and the indexes match: nothing is scanned or built.
	EXECUTE format('ALTER TABLE processed_job_events ATTACH PARTITION processed_job_events_legacy FOR VALUES FROM (MINVALUE) TO (%L)', bound);

	-- A week of days ahead; the retention round keeps them coming.
	FOR i IN 0..6 LOOP
		day := bound + i * interval '1 day';
		EXECUTE format('CREATE TABLE %I PARTITION OF processed_job_events FOR VALUES FROM (%L) TO (%L)',
			'processed_job_events_p' || to_char(day AT TIME ZONE 'UTC', 'YYYYMMDD'), day, day + interval '1 day');
	END LOOP;
END $$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
DO $$
DECLARE
	last bigint;
BEGIN
	IF (SELECT relkind FROM pg_class WHERE oid = 'processed_job_events'::regclass) <> 'p' THEN
		RETURN;
	END IF;
	LOCK TABLE processed_job_events IN ACCESS EXCLUSIVE MODE;
	ALTER TABLE processed_job_events DETACH PARTITION processed_job_events_legacy;
	ALTER TABLE processed_job_events_legacy DROP CONSTRAINT IF EXISTS processed_job_events_legacy_bound;
	INSERT INTO processed_job_events_legacy SELECT * FROM processed_job_events;
	SELECT coalesce(max(id), 0) INTO last FROM processed_job_events_legacy;
	DROP TABLE processed_job_events;
	ALTER TABLE processed_job_events_legacy RENAME TO processed_job_events;
	ALTER INDEX processed_job_events_legacy_key_idx RENAME TO processed_job_events_key_idx;
	ALTER INDEX processed_job_events_legacy_at_idx RENAME TO processed_job_events_at_idx;
	EXECUTE format('ALTER TABLE processed_job_events ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (START WITH %s)', last + 1);
END $$;
-- +goose StatementEnd
