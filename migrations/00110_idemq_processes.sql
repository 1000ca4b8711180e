-- +goose Up
-- The long-running processes of a deployment (worker, api, scheduler), each with the
-- release and schema version it runs. A process inserts its row at start, refreshes
-- heartbeat_at about every 15 s and deletes the row when it stops cleanly; whoever
-- heartbeats deletes rows silent for an hour. `idemq migrate` reads it to refuse a
-- contract step while a process of an older schema is alive. Registration is best
-- effort: a process that cannot write here keeps running, and binaries older than this
-- table never register. A new table: nothing older reads or writes it.
CREATE TABLE idemq_processes (
    id             uuid        PRIMARY KEY,
    role           text        NOT NULL CHECK (role ~ '^[a-z_]{1,32}$'),
    version        text        NOT NULL CHECK (octet_length(version) BETWEEN 1 AND 128),
    commit         text        NOT NULL CHECK (octet_length(commit) <= 64),
    schema_version bigint      NOT NULL CHECK (schema_version >= 0),
    host           text        NOT NULL CHECK (octet_length(host) <= 255),
    pid            int         NOT NULL,
    started_at     timestamptz NOT NULL DEFAULT now(),
    heartbeat_at   timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE idemq_processes;
