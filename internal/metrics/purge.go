package metrics

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// purgeBacklog exports idemq_purge_backlog_rows, the rows the last retention round of
// this process left to purge, while that value stands
// (idempotency.Config.ObservePurgeBacklog): a process whose turn has not come for a while
// sends no series rather than an old value.
type purgeBacklog struct {
	desc *prometheus.Desc

	mu    sync.Mutex
	rows  int64
	until time.Time // the value stands until then; zero before the first round
}

func newPurgeBacklog() *purgeBacklog {
	return &purgeBacklog{desc: prometheus.NewDesc("idemq_purge_backlog_rows",
		"Rows past the retention window that the last retention round of this process left to purge (0: it caught up), counted up to 1,000,000 per table; absent from a process that has run no round for three intervals.",
		nil, nil)}
}

// Describe implements prometheus.Collector.
func (c *purgeBacklog) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

// Collect implements prometheus.Collector.
func (c *purgeBacklog) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	rows, until := c.rows, c.until
	c.mu.Unlock()
	if time.Now().Before(until) {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(rows))
	}
}

// ObservePurgeBacklog records the rows a retention round left to purge, exported for
// validFor (idempotency.Config.ObservePurgeBacklog).
func (m *Metrics) ObservePurgeBacklog(rows int64, validFor time.Duration) {
	c := m.purgeBacklog
	c.mu.Lock()
	defer c.mu.Unlock()
	c.rows, c.until = rows, time.Now().Add(validFor)
}
