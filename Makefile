# idemq — the commands a developer types.
GO      ?= go
BIN     ?= bin/idemq
PKGS    ?= ./...

.PHONY: test build lint migrate up down cover demo screenshots

## test: vet, format check, then every test with the race detector against real Redis and
## Postgres. A test that needs a program which is not installed (chromium, pgbouncer,
## prometheus's promtool) skips, except under CI=true, where it fails; the last line then
## says what was skipped and how to install it. The timeout leaves room for a loaded box:
## cmd/idemq, the longest package, takes about 7 minutes on an idle 2-core one. Then the
## examples module's tests (examples/, a module of its own: the ORM examples), with the same
## flags, whether or not idemq's passed; either failing fails make test. EXAMPLE_PKGS= skips them.
TEST_TIMEOUT ?= 30m
EXAMPLE_PKGS ?= ./...
test: lint
	@echo "$(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) $(PKGS)"; skips=$$(mktemp); \
	IDEMQ_SKIP_LOG=$$skips $(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) $(PKGS); rc=$$?; \
	if [ -n "$(EXAMPLE_PKGS)" ]; then \
		echo "cd examples && $(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) $(EXAMPLE_PKGS)"; \
		(cd examples && IDEMQ_SKIP_LOG=$$skips $(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) $(EXAMPLE_PKGS)) || rc=1; \
	fi; \
	if [ -s $$skips ]; then \
		echo "make test: skipped $$(wc -l <$$skips) tests for want of: $$(sort $$skips | uniq -c | awk -F'\t' '{split($$1, a, " "); printf "%s%s (%s tests; %s)", sep, a[2], a[1], $$2; sep="; "}')"; \
	fi; \
	rm -f $$skips; exit $$rc

## build: the idemq binary in bin/
build:
	$(GO) build -o $(BIN) ./cmd/idemq

## lint: go vet (idemq's packages, then the examples module's) and a gofmt check of every
## tracked Go file, the examples' and their generated code included
lint:
	$(GO) vet $(PKGS)
	cd examples && $(GO) vet ./...
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

## cover: tests with a coverage summary per package
cover:
	$(GO) test -race -count=1 -cover $(PKGS)

## bench: bare asynq against + lock, + ledger and the full stack, interleaved (defaults: about
## 2 minutes), with idemq-bench (cmd/idemq-bench, a tool of its own, not in the idemq
## binary); writes docs/bench/bench.json and docs/bench/bench.svg. A full run (about 10 minutes):
## make bench BENCH_FLAGS="-seconds 6 -workloads noop,debit,charge,scale,io,latency,dup -write-docs"
## Worker RSS, one process per configuration over 100,000 tasks (a few minutes):
## make bench BENCH_FLAGS="-memory"
## Recorded steps: order:checkout (three steps) in `idemq worker` against unguarded.Checkout in
## bare asynq, paired, with what a step record costs per process beside a leased one-effect
## charge (2,000 checkouts and 4,000 charges, c=10 and 50, 3 reps):
## make bench BENCH_FLAGS="-drain -drain-workloads charge-distinct,checkout-distinct -drain-concurrency 10,50 -reps 3 -drain-n 8000 -json docs/bench/bench-drain-checkout.json"
BENCH_FLAGS ?= -write-docs
.PHONY: bench
bench:
	$(GO) run ./cmd/idemq-bench $(BENCH_FLAGS)

## bench-river: idemq's exactly-once debits against River's (river.JobCompleteTx), paired in one
## drain run (debit-distinct and debit-hot at concurrency 10 and 50; about 2 minutes at these
## sizes). riverdrain is built from internal/bench/river, a module of its own, and the idemq
## binary whose worker is measured from cmd/idemq (-idemq build).
RIVER_FLAGS ?= -reps 3 -drain-n 2000
.PHONY: bench-river
bench-river:
	$(GO) run ./cmd/idemq-bench -drain -drain-workloads debit-distinct,debit-hot -drain-concurrency 10,50 -drain-river build $(RIVER_FLAGS)

## migrate: apply migrations to DATABASE_URL
migrate: build
	$(BIN) migrate

## up / down: the whole stack with Docker Compose
up:
	IDEMQ_COMMIT=$$(git rev-parse HEAD 2>/dev/null) docker compose up -d --build
down:
	docker compose down

## compose-check: compose.yaml as Docker Compose v2 loads it (docker compose config, or, where it
## is not installed, compose-go, its loader and schema, from .ci/composecheck)
.PHONY: compose-check
compose-check:
	@if docker compose version >/dev/null 2>&1; then IDEMQ_API_TOKEN=$$(printf '%064d' 0) docker compose config -q && echo "compose.yaml: valid (docker compose config)"; \
	else cd .ci/composecheck && $(GO) run . ../../compose.yaml; fi

## screenshots: docs/dashboard.png, docs/ledger.png and docs/history.png, from the API's browser tests (needs chromium)
screenshots:
	IDEMQ_SCREENSHOT_DIR=$(CURDIR)/docs $(GO) test -count=1 -run 'TestBrowserRendersDashboardAndLedger|TestBrowserShowsHistory' ./internal/api/

## demo: the whole story on one machine (see README)
demo:
	$(GO) run ./cmd/idemq demo

## faults-short: the fault-injection proof, short profile (about 5 minutes; private Postgres and Redis)
faults-short:
	$(GO) test -tags faults -count=1 -run TestProof -timeout 15m ./internal/faults/ -v

## faults: the fault-injection proof, long profile (about 40 minutes, with a Sentinel run, a Postgres-standby run and, after them, a mixed-version run); report in docs/proof/report.{json,txt}
faults:
	IDEMQ_FAULTS_PROFILE=long IDEMQ_FAULTS_REPORT=$(CURDIR)/docs/proof/report.json \
		$(GO) test -tags faults -count=1 -run TestProof -timeout 55m ./internal/faults/ -v
