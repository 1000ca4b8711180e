-- CheckResult's statement: the server parses the result ($1) as jsonb. A value jsonb
-- refuses fails with a data exception (class 22).
SELECT $1::text::jsonb IS NULL
