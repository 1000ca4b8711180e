package metrics

import (
	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
)

// QueueCollector exports asynq's queue state, read through an Inspector at each scrape.
type QueueCollector struct {
	insp *asynq.Inspector

	tasks, latency, paused, up *prometheus.Desc
}

// NewQueueCollector returns a collector of insp's queues.
func NewQueueCollector(insp *asynq.Inspector) *QueueCollector {
	return &QueueCollector{
		insp:    insp,
		tasks:   prometheus.NewDesc("asynq_tasks_enqueued", "Tasks in a queue by state.", []string{"queue", "state"}, nil),
		latency: prometheus.NewDesc("asynq_queue_latency_seconds", "Age of the oldest pending task.", []string{"queue"}, nil),
		paused:  prometheus.NewDesc("asynq_queue_paused", "1 when the queue is paused.", []string{"queue"}, nil),
		up:      prometheus.NewDesc("asynq_inspector_up", "1 when the last scrape could read the queues.", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *QueueCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.tasks
	ch <- c.latency
	ch <- c.paused
	ch <- c.up
}

// Collect implements prometheus.Collector.
func (c *QueueCollector) Collect(ch chan<- prometheus.Metric) {
	queues, err := c.insp.Queues()
	if err != nil {
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 0)
		return
	}
	for _, q := range queues {
		info, err := c.insp.GetQueueInfo(q)
		if err != nil {
			continue
		}
		for state, n := range map[string]int{
			"pending": info.Pending, "active": info.Active, "scheduled": info.Scheduled,
			"retry": info.Retry, "archived": info.Archived, "completed": info.Completed,
		} {
			ch <- prometheus.MustNewConstMetric(c.tasks, prometheus.GaugeValue, float64(n), q, state)
		}
		ch <- prometheus.MustNewConstMetric(c.latency, prometheus.GaugeValue, info.Latency.Seconds(), q)
		paused := 0.0
		if info.Paused {
			paused = 1
		}
		ch <- prometheus.MustNewConstMetric(c.paused, prometheus.GaugeValue, paused, q)
	}
	ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 1)
}
