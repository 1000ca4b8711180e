// Package metrics holds idemq's Prometheus metrics and serves them with the health
// endpoints.
package metrics

import (
	"context"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/internal/release"
)

// Metrics is one process's registry and idemq's collectors in it. Safe for concurrent use.
// Make it with New. Its Observe methods find their series without WithLabelValues's cost;
// the vectors' series must not be deleted (see bound).
type Metrics struct {
	Registry *prometheus.Registry

	// LedgerEvents counts ledger outcomes (claimed, cache_hit, busy, mismatch, takeover,
	// completed, lease_lost, …) by task type.
	LedgerEvents *prometheus.CounterVec
	// LockEvents counts Redis lock outcomes (obtained, busy, lost, error) by task type.
	LockEvents *prometheus.CounterVec
	// OutboxEvents counts relay and reconciler events (published, republished,
	// republish_alert, relay_error) by task type.
	OutboxEvents *prometheus.CounterVec
	// HandlerDuration observes each delivery's handling time by task type and outcome.
	HandlerDuration *prometheus.HistogramVec
	// APIRequests counts the API's answers by route pattern and status code.
	APIRequests *prometheus.CounterVec
	// CommitRequests observes how many ledger requests each shared commit carried, by
	// kind (claim, complete, tx, heartbeat).
	CommitRequests *prometheus.HistogramVec
	// IntentsDead counts accepted jobs whose own task a worker refused, so that their
	// outbox intent is dead, by reason (mismatch, failed, needs_attention, invalid; archived
	// when the reconciler found the task archived) and task type.
	IntentsDead *prometheus.CounterVec
	// Steps counts recorded-step calls (idempotency.Step, StepTx) by task type, step name
	// and outcome (ran, cached, lease_lost, mismatch, error).
	Steps *prometheus.CounterVec
	// ScheduleTicks counts what became of periodic ticks (schedule.Event: enqueued,
	// duplicate, caught_up, skipped, mismatch) by schedule entry.
	ScheduleTicks *prometheus.CounterVec
	// AsynqRecovered counts tasks asynq recovered after their lease expired (a worker
	// died or lost Redis mid-task) by task type (server.Config.ObserveRecovered).
	AsynqRecovered *prometheus.CounterVec
	// OverBudget counts deliveries that found their key busy, or Postgres unavailable,
	// past the busy budget, by reason (busy, unavailable) and task type
	// (server.Config.ObserveOverBudget).
	OverBudget *prometheus.CounterVec
	// HistoryEvents counts the events of keys' histories by outcome (written, dropped:
	// the buffer was full, failed: the write failed); see idempotency.Ledger.Record.
	HistoryEvents *prometheus.CounterVec
	// PurgeRows counts the rows the retention purge (idempotency.Config.ObservePurge) and
	// the API's purge of Idempotency-Key rows deleted, by table; PurgeSeconds times each
	// of their batch statements.
	PurgeRows    *prometheus.CounterVec
	PurgeSeconds prometheus.Histogram
	// purgeBacklog is idemq_purge_backlog_rows (ObservePurgeBacklog).
	purgeBacklog *purgeBacklog

	// The children of the vectors a delivery touches, bound once per label values.
	ledgerEvents, lockEvents, outboxEvents, steps *bound[prometheus.Counter]
	handlerDuration, commitRequests               *bound[prometheus.Observer]
}

// New returns a registry with the Go runtime and process collectors and idemq's own.
func New() *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		LedgerEvents: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemq_ledger_events_total",
			Help: "Ledger outcomes by event (claimed, takeover, cache_hit, busy, mismatch, completed, lease_lost, …) and task type.",
		}, []string{"event", "task_type"}),
		LockEvents: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemq_lock_events_total",
			Help: "Redis lock outcomes (obtained, busy, lost, error) by task type.",
		}, []string{"event", "task_type"}),
		OutboxEvents: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemq_outbox_events_total",
			Help: "Outbox events (published, republished, republish_alert, relay_error) by task type.",
		}, []string{"event", "task_type"}),
		HandlerDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idemq_handler_duration_seconds",
			Help:    "Time to handle one delivery, from decode to lock release, by task type and outcome.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 14),
		}, []string{"task_type", "outcome"}),
		APIRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemq_api_requests_total",
			Help: "API answers by route pattern (such as \"POST /v1/charges\") and status code.",
		}, []string{"route", "code"}),
		CommitRequests: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idemq_ledger_commit_requests",
			Help:    "Ledger requests per shared commit, by kind (claim, complete, tx, heartbeat).",
			Buckets: []float64{1, 2, 4, 8, 16, 32, 64, 128},
		}, []string{"kind"}),
		IntentsDead: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemq_intents_dead_total",
			Help: "Accepted jobs whose own task was refused, their intent dead, by reason (mismatch, failed, needs_attention, invalid, archived) and task type.",
		}, []string{"reason", "task_type"}),
		Steps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemq_steps_total",
			Help: "Recorded-step calls by task type, step name and outcome (ran, cached, lease_lost, mismatch, error).",
		}, []string{"task_type", "step", "outcome"}),
		ScheduleTicks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemq_schedule_ticks_total",
			Help: "Periodic ticks by schedule entry and event (enqueued, duplicate: already enqueued by another replica, caught_up, skipped, mismatch).",
		}, []string{"entry", "event"}),
		AsynqRecovered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemq_asynq_recovered_total",
			Help: "Tasks asynq recovered after their lease expired (their worker died or lost Redis mid-task), by task type; asynq counts each as a failed attempt.",
		}, []string{"task_type"}),
		OverBudget: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemq_busy_budget_exceeded_total",
			Help: "Deliveries that found their key busy, or Postgres unavailable, past the busy budget, by reason (busy, unavailable) and task type; each counts as a failure.",
		}, []string{"reason", "task_type"}),
		HistoryEvents: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemq_history_events_total",
			Help: "Events of keys' histories (processed_job_events) by outcome: written, dropped (the buffer was full), failed (the write failed).",
		}, []string{"outcome"}),
		PurgeRows: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemq_purge_rows_total",
			Help: "Rows the purges deleted, by table: processed_jobs (terminal rows past the window, with their intents and steps), job_intents (dead intents without a ledger row), processed_job_events (days of keys' histories dropped whole, rows estimated from statistics), api_idempotency_keys (the API's remembered Idempotency-Key headers).",
		}, []string{"table"}),
		PurgeSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "idemq_purge_seconds",
			Help:    "Duration of each statement of the purges: a batch (its own transaction, at most 1,000 rows), or a day of keys' histories detached and dropped (table processed_job_events).",
			Buckets: []float64{.001, .005, .01, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}),
		purgeBacklog: newPurgeBacklog(),
	}
	m.ledgerEvents = newBound(m.LedgerEvents.WithLabelValues)
	m.lockEvents = newBound(m.LockEvents.WithLabelValues)
	m.outboxEvents = newBound(m.OutboxEvents.WithLabelValues)
	m.handlerDuration = newBound(m.HandlerDuration.WithLabelValues)
	m.commitRequests = newBound(m.CommitRequests.WithLabelValues)
	m.steps = newBound(m.Steps.WithLabelValues)
	b := release.Current()
	buildInfo := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "idemq_build_info",
		Help:        "Always 1; its labels name the binary: version (a release, or devel), commit (unknown for a build without version control information) and schema (the highest core migration it embeds).",
		ConstLabels: prometheus.Labels{"version": b.Version, "commit": b.RevisionOrUnknown(), "schema": strconv.FormatInt(b.Schema, 10)},
	})
	buildInfo.Set(1)
	m.Registry.MustRegister(
		buildInfo,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.LedgerEvents, m.LockEvents, m.OutboxEvents, m.HandlerDuration, m.APIRequests,
		m.CommitRequests, m.IntentsDead, m.Steps, m.ScheduleTicks, m.AsynqRecovered, m.OverBudget, m.HistoryEvents,
		m.PurgeRows, m.PurgeSeconds, m.purgeBacklog,
	)
	return m
}

// Init creates at zero, for each task type, the series of the events idemq's alerts
// watch (deploy/prometheus/rules.yml): increase() over a series that appears with its
// first event at 1 sees no increase, so without this the first mismatch, lost lease or
// dead intent of a process would not alert.
func (m *Metrics) Init(taskTypes ...string) {
	for _, tt := range taskTypes {
		for _, ev := range []string{"completed", "cache_hit", "busy", "takeover", "mismatch", "needs_attention",
			"lease_lost", "self_fenced", "commit_resolved", "commit_unknown"} {
			m.ledgerEvents.get(ev, tt)
		}
		m.lockEvents.get("busy", tt)
		for _, ev := range []string{"republished", "republish_alert"} {
			m.outboxEvents.get(ev, tt)
		}
		for _, reason := range []string{"mismatch", "failed", "needs_attention", "invalid", "archived"} {
			m.IntentsDead.WithLabelValues(reason, tt)
		}
		for _, reason := range []string{"busy", "unavailable"} {
			m.OverBudget.WithLabelValues(reason, tt)
		}
		m.AsynqRecovered.WithLabelValues(tt)
	}
}

// ObserveHandler records one delivery's handling time (asynqmw.Config.ObserveHandler),
// with the trace id of ctx's span as the observation's exemplar when it is sampled.
func (m *Metrics) ObserveHandler(ctx context.Context, taskType, outcome string, d time.Duration) {
	o := m.handlerDuration.get(taskType, outcome)
	if sc := trace.SpanContextFromContext(ctx); sc.IsSampled() {
		o.(prometheus.ExemplarObserver).ObserveWithExemplar(d.Seconds(), prometheus.Labels{"trace_id": sc.TraceID().String()})
		return
	}
	o.Observe(d.Seconds())
}

// ObserveLedger counts a ledger event of a task type in LedgerEvents
// (idempotency.Config.Observe).
func (m *Metrics) ObserveLedger(event, taskType string) {
	m.ledgerEvents.get(event, taskType).Inc()
}

// ObserveStep counts a step call's outcome in Steps (idempotency.Config.ObserveStep).
// Step names come from handler code, so the series stay few. A step's mismatch series
// starts at zero with its first call (see Init), so that the alert on it sees the first
// mismatch of a step this process has run before.
func (m *Metrics) ObserveStep(taskType, step, outcome string) {
	m.steps.get3(taskType, step, outcome).Inc()
	if outcome != "mismatch" {
		m.steps.get3(taskType, step, "mismatch")
	}
}

// ObserveHistory counts n events of keys' histories by outcome in HistoryEvents
// (idempotency.Config.ObserveHistory).
func (m *Metrics) ObserveHistory(outcome string, n int) {
	m.HistoryEvents.WithLabelValues(outcome).Add(float64(n))
}

// ObservePurge records one batch statement of a purge: the retention purge's
// (idempotency.Config.ObservePurge) or the API's of Idempotency-Key rows.
func (m *Metrics) ObservePurge(table string, rows int64, took time.Duration) {
	m.PurgeRows.WithLabelValues(table).Add(float64(rows))
	m.PurgeSeconds.Observe(took.Seconds())
}

// ObserveBatch records how many requests a shared commit of a kind carried in
// CommitRequests (idempotency.Config.ObserveBatch).
func (m *Metrics) ObserveBatch(kind string, n int) {
	m.commitRequests.get1(kind).Observe(float64(n))
}

// ObserveLock counts a lock outcome of a task type in LockEvents
// (asynqmw.Config.ObserveLock).
func (m *Metrics) ObserveLock(event, taskType string) {
	m.lockEvents.get(event, taskType).Inc()
}

// ObserveOutbox counts an outbox event of a task type in OutboxEvents
// (outbox.Config.Observe).
func (m *Metrics) ObserveOutbox(event, taskType string) {
	m.outboxEvents.get(event, taskType).Inc()
}

// Check is a readiness probe of one dependency.
type Check func(ctx context.Context) error

// Handler serves /metrics, /healthz (the process answers) and /readyz (see ReadyHandler;
// log gets the failures, nil discards them).
func (m *Metrics) Handler(checks map[string]Check, log *slog.Logger) http.Handler {
	mux := http.NewServeMux()
	// OpenMetrics when the scraper asks for it: the format that carries exemplars.
	mux.Handle("GET /metrics", promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{Registry: m.Registry, EnableOpenMetrics: true}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("ok\n")) })
	mux.HandleFunc("GET /readyz", ReadyHandler(checks, log))
	return mux
}

// ReadyHandler answers 200 when every check passes within 2 seconds, else 503 naming the
// first failing check ("postgres: unavailable"). The endpoint is unauthenticated, so the
// error itself, which may carry a user, a database or an address, goes to log only (nil
// discards it).
func ReadyHandler(checks map[string]Check, log *slog.Logger) http.HandlerFunc {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		for name, check := range checks {
			if err := check(ctx); err != nil {
				log.Warn("readyz: "+name+" unavailable", "check", name, "err", err)
				http.Error(w, name+": unavailable", http.StatusServiceUnavailable)
				return
			}
		}
		w.Write([]byte("ready\n"))
	}
}
