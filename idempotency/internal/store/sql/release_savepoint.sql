-- Release ends a DoTx member's savepoint, keeping the member's work.
RELEASE SAVEPOINT idemq_member
