// Package adoption holds a test that adopts idemq as a library user would: it writes a
// Go module of its own outside the repository (an application with its own goose
// migrations, a transactional and a leased handler on idempotency/server, a main that
// runs them until SIGTERM, and a test of its handlers with idempotency/idempotencytest),
// builds, vets and tests it with the go command, then runs its binary against Postgres and
// a Redis that loses its data mid-run, and checks that every job took effect exactly once.
//
// The application's files are in testdata/shop; the test adds its go.mod (with a replace
// of idemq by this repository) and idemq's go.sum.
package adoption
