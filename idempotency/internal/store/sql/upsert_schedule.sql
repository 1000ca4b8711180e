-- UpsertScheduleSQL writes entries ($1 names, $2 specs, $3 sums) and deletes the rows of
-- entries not among them: a new entry starts at revision 1, a changed one gets the next
-- revision and a new revised_at, an unchanged one is left as it is (paused or not).
WITH e AS (
	SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[]) AS e(name, spec, sum)
), gone AS (
	DELETE FROM schedule_entries WHERE name <> ALL ($1::text[])
)
INSERT INTO schedule_entries AS s (name, spec, spec_sha256)
SELECT name, spec::jsonb, sum FROM e
ON CONFLICT (name) DO UPDATE
SET spec = excluded.spec, spec_sha256 = excluded.spec_sha256, revision = s.revision + 1,
    revised_at = now(), updated_at = now()
WHERE s.spec_sha256 <> excluded.spec_sha256
