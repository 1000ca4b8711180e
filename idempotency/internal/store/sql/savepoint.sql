-- Savepoint opens a DoTx member's savepoint. With several members, each may run in a
-- savepoint of its own, released when it succeeds and rolled back when it does not; one
-- name serves all, as the previous member's savepoint is gone before the next one is
-- made.
SAVEPOINT idemq_member
