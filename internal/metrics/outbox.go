package metrics

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemq/idemq/idempotency/outbox"
)

// OutboxCollector exports the outbox's backlog at each scrape: relay lag (the oldest
// pending intent), the oldest published intent not yet done, and accepted jobs still not
// done after the threshold.
type OutboxCollector struct {
	client    *outbox.Client
	threshold time.Duration

	pending, lag, published, oldestPublished, stale *prometheus.Desc
}

// NewOutboxCollector returns a collector of client's outbox; threshold is the age past
// which a published, unfinished job counts as stale (the reconciler's grace period).
func NewOutboxCollector(client *outbox.Client, threshold time.Duration) *OutboxCollector {
	return &OutboxCollector{
		client: client, threshold: threshold,
		pending:         prometheus.NewDesc("idemq_outbox_pending", "Accepted jobs not yet handed to asynq.", nil, nil),
		lag:             prometheus.NewDesc("idemq_outbox_relay_lag_seconds", "Age of the oldest job not yet handed to asynq.", nil, nil),
		published:       prometheus.NewDesc("idemq_outbox_published_unfinished", "Jobs handed to asynq and not yet completed or failed.", nil, nil),
		oldestPublished: prometheus.NewDesc("idemq_outbox_oldest_published_seconds", "Age of the oldest job handed to asynq and not yet completed or failed (0 when none).", nil, nil),
		stale:           prometheus.NewDesc("idemq_outbox_stale", "Jobs handed to asynq longer ago than the reconcile grace period and still unfinished.", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *OutboxCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.pending
	ch <- c.lag
	ch <- c.published
	ch <- c.oldestPublished
	ch <- c.stale
}

// Collect implements prometheus.Collector.
func (c *OutboxCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	s, err := c.client.Stats(ctx, c.threshold)
	if err != nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(s.Pending))
	ch <- prometheus.MustNewConstMetric(c.lag, prometheus.GaugeValue, s.OldestPending.Seconds())
	ch <- prometheus.MustNewConstMetric(c.published, prometheus.GaugeValue, float64(s.Published))
	ch <- prometheus.MustNewConstMetric(c.oldestPublished, prometheus.GaugeValue, s.OldestPublished.Seconds())
	ch <- prometheus.MustNewConstMetric(c.stale, prometheus.GaugeValue, float64(s.PublishedOlderThan))
}
