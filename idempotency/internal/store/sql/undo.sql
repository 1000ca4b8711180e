-- Undo rolls a failed DoTx member's work back and ends its savepoint. It runs alone, in
-- the simple protocol, which an aborted transaction accepts.
ROLLBACK TO SAVEPOINT idemq_member; {{template "release_savepoint"}}
