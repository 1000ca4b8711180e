// Package api is idemq's web side: the enqueue API (POST /v1/charges, POST
// /v1/wallet/debits, POST /v1/checkouts, GET /v1/jobs/{key}, GET /v1/schedule), the
// asynqmon dashboard at /monitoring/, a server-rendered ledger page at /ledger/ with the
// schedule of periodic jobs at /schedule/, and /metrics, /healthz and /readyz. The
// dashboard and the ledger page show every payload: they ask for Options.DashboardPassword,
// or, without one, answer 403 unless Options.ListenAddr is loopback; they refuse
// cross-origin writes and send a Content-Security-Policy and X-Frame-Options: DENY. The
// API asks for a bearer token of Options.APITokens, or, without one, answers 403 unless
// Options.ListenAddr is loopback; it refuses cross-origin writes and bodies not declared
// application/json (415). Whatever is served without a password or token because the
// address is loopback answers only requests whose Host is localhost or a loopback address
// (421 otherwise), so a DNS-rebinding page cannot reach it.
//
// Usage:
//
//	client := outbox.NewClient(pool, rdb, nil)
//	go client.RunRelay(ctx) // publishes what the API accepts
//	h := api.New(api.Deps{Pool: pool, Redis: rdb, Ledger: ledger, Enqueuer: client, Metrics: metrics.New()},
//		&api.Options{RedisConnOpt: asynq.RedisClientOpt{Addr: "127.0.0.1:6379"},
//			DashboardUser: "ops", DashboardPassword: "secret", APITokens: []string{token}})
//	defer h.Close()
//	go h.PurgeKeysEvery(ctx, time.Hour, 24*time.Hour)
//	httpserver.Serve(ctx, ":8080", h, log, &httpserver.Options{ShutdownTimeout: 30 * time.Second})
//
// A POST records the job's intent (through Enqueuer.EnqueueTx, an outbox) and, when the
// client sent an Idempotency-Key header, the header's row in api_idempotency_keys, in one
// Postgres transaction: either both are stored or neither. The job key always comes from
// intent (charge:<order_id>, debit:<reference>, checkout:<order_id>), so two requests for one order never make
// two jobs, whatever their headers say.
package api
