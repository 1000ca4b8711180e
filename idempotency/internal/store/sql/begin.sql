-- Begins a DoTx transaction (BeginClaims).
BEGIN ISOLATION LEVEL READ COMMITTED
