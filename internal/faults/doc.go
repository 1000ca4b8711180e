// Package faults is idemq's fault-injection proof suite, in the manner of Jepsen sized to
// one machine: a workload of charges, debits (on half the workers through database/sql,
// server.HandleSQLTx over pgx's stdlib) and checkouts (recorded steps) with duplicate
// deliveries, two scheduler replicas enqueueing a settlement every 2 s, a seeded
// nemesis (worker and scheduler SIGKILL/SIGSTOP/SIGTERM, Redis SIGKILL, Postgres immediate
// shutdown, terminated backends, handler fault points; with a synchronous standby,
// promotions), a recorded history and an offline checker (every tick exactly once among
// them), plus negative controls that must find duplicates or gaps when a guard is
// switched off.
//
// The tests sit behind the faults build tag and start their own Postgres and Redis on
// loopback (internal/localserver) and the real idemq binary:
//
//	go test -tags faults -count=1 -run TestProof -timeout 15m ./internal/faults/ -v
//
// IDEMQ_FAULTS_PROFILE (short or long), IDEMQ_FAULTS_SEED (replay a run) and
// IDEMQ_FAULTS_REPORT (where the JSON report goes) tune a run; IDEMQ_FAULTS_SENTINEL=1 and
// IDEMQ_FAULTS_STANDBY=1 add the long profile's Sentinel and Postgres-standby runs to a
// short one; IDEMQ_FAULTS_KEEP=DIR keeps the process logs of a failed run (worker, api,
// scheduler, fakepay) under DIR. docs/proof.md explains the failure model and the report.
package faults
