package metrics

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemq/idemq/idempotency"
)

// LedgerCollector exports the ledger rows that need an operator (status
// needs_attention). They are counted from the index of the open rows (a schema before
// 113 scans processed_jobs), and a scrape reuses the last count while it is younger than
// the collector's interval.
type LedgerCollector struct {
	ledger *idempotency.Ledger
	every  time.Duration

	needsAttention *prometheus.Desc

	mu   sync.Mutex
	at   time.Time // when n was read; zero before the first read
	n    int64
	read bool // the last read succeeded
}

// NewLedgerCollector returns a collector of ledger's rows that reads them at most once
// per every (at least 1 s).
func NewLedgerCollector(ledger *idempotency.Ledger, every time.Duration) *LedgerCollector {
	return &LedgerCollector{
		ledger: ledger, every: max(every, time.Second),
		needsAttention: prometheus.NewDesc("idemq_ledger_needs_attention", "Ledger rows in status needs_attention: stuck past the maximum age, waiting for an operator (idemq ledger list --status needs_attention).", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *LedgerCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.needsAttention }

// Collect implements prometheus.Collector. It sends nothing while the ledger cannot be
// read, so that an alert on the gauge neither fires nor resolves on a database outage.
func (c *LedgerCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.at.IsZero() || time.Since(c.at) >= c.every {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		n, err := c.ledger.CountStatus(ctx, idempotency.StatusNeedsAttention)
		cancel()
		c.at, c.n, c.read = time.Now(), n, err == nil
	}
	if c.read {
		ch <- prometheus.MustNewConstMetric(c.needsAttention, prometheus.GaugeValue, float64(c.n))
	}
}
