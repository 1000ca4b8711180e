package bench

import (
	"encoding/json"
	"fmt"
	"html"
	"io"
	"slices"
	"strings"
)

// Stat is the median, minimum and maximum of one figure over the repetitions.
type Stat struct {
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
}

func stat(v []float64) Stat {
	if len(v) == 0 {
		return Stat{}
	}
	s := slices.Clone(v)
	slices.Sort(s)
	m := s[len(s)/2]
	if len(s)%2 == 0 {
		m = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return Stat{Median: m, Min: s[0], Max: s[len(s)-1]}
}

// Row summarises one configuration of one workload over the repetitions.
type Row struct {
	Workload        string `json:"workload"`
	Config          string `json:"config"`
	Name            string `json:"name"`
	Servers         int    `json:"servers"`
	Reps            int    `json:"reps"`
	N               Stat   `json:"n"`
	TasksPerSecond  Stat   `json:"tasks_per_s"`
	ThroughputRatio Stat   `json:"throughput_ratio"`
	OverheadP50us   Stat   `json:"overhead_p50_us"`
	OverheadP99us   Stat   `json:"overhead_p99_us"`
	CPUGo           Stat   `json:"cpu_go_us"`
	CPURedis        Stat   `json:"cpu_redis_us"`
	CPUPostgres     Stat   `json:"cpu_postgres_us"`
	CPUTotal        Stat   `json:"cpu_total_us"`
	CPURatio        Stat   `json:"cpu_ratio"`
	RowsPerCommit   Stat   `json:"rows_per_commit"`
	Errors          int    `json:"errors"`
}

// summarize fills each sample's ratios to bare asynq of the same repetition and the rows.
func (r *Report) summarize() {
	bare := map[string]*Sample{}
	gk := func(s *Sample) string { return fmt.Sprintf("%s/%d/%d", s.Workload, s.Servers, s.Rep) }
	for i := range r.Samples {
		if s := &r.Samples[i]; s.Config == ConfigBare {
			bare[gk(s)] = s
		}
	}
	type rowKey struct {
		workload, config string
		servers          int
	}
	var order []rowKey
	byRow := map[rowKey][]*Sample{}
	for i := range r.Samples {
		s := &r.Samples[i]
		if b := bare[gk(s)]; b != nil {
			s.ThroughputRatio = s.TasksPerSecond / b.TasksPerSecond
			if b.CPU.Total > 0 {
				s.CPURatio = s.CPU.Total / b.CPU.Total
			}
		}
		k := rowKey{s.Workload, s.Config, s.Servers}
		if _, ok := byRow[k]; !ok {
			order = append(order, k)
		}
		byRow[k] = append(byRow[k], s)
	}
	r.Rows = nil
	for _, k := range order {
		ss := byRow[k]
		col := func(f func(*Sample) float64) Stat {
			v := make([]float64, len(ss))
			for i, s := range ss {
				v[i] = f(s)
			}
			return stat(v)
		}
		row := Row{Workload: k.workload, Config: k.config, Name: ConfigNames[k.config], Servers: k.servers, Reps: len(ss),
			N:               col(func(s *Sample) float64 { return float64(s.N) }),
			TasksPerSecond:  col(func(s *Sample) float64 { return s.TasksPerSecond }),
			ThroughputRatio: col(func(s *Sample) float64 { return s.ThroughputRatio }),
			OverheadP50us:   col(func(s *Sample) float64 { return s.OverheadP50us }),
			OverheadP99us:   col(func(s *Sample) float64 { return s.OverheadP99us }),
			CPUGo:           col(func(s *Sample) float64 { return s.CPU.Go }),
			CPURedis:        col(func(s *Sample) float64 { return s.CPU.Redis }),
			CPUPostgres:     col(func(s *Sample) float64 { return s.CPU.Postgres }),
			CPUTotal:        col(func(s *Sample) float64 { return s.CPU.Total }),
			CPURatio:        col(func(s *Sample) float64 { return s.CPURatio }),
			RowsPerCommit:   col(func(s *Sample) float64 { return s.RowsPerCommit }),
		}
		for _, s := range ss {
			row.Errors += s.Errors
		}
		r.Rows = append(r.Rows, row)
	}
}

func rng(s Stat, format string) string {
	return fmt.Sprintf(format+" ("+format+"–"+format+")", s.Median, s.Min, s.Max)
}

func (r *Report) workloadLabel(row Row) string {
	switch row.Workload {
	case "scale":
		return fmt.Sprintf("noop, %d server(s)", row.Servers)
	case "io":
		return fmt.Sprintf("noop + %g ms sleep", r.Options.IOWaitMS)
	case "latency":
		return fmt.Sprintf("noop at %g/s, concurrency 10", r.Options.LatencyRate)
	case "dup":
		return "noop, each key ×3"
	}
	return row.Workload
}

// WriteTable prints the rows as a Markdown table: medians over the repetitions, with
// min–max in parentheses; ratios are to bare asynq in the same repetition.
func (r *Report) WriteTable(w io.Writer) error {
	var b strings.Builder
	if len(r.Rows) == 0 && r.Memory != nil {
		b.WriteString("idemq-bench -memory: ")
	} else {
		fmt.Fprintf(&b, "idemq-bench: %d rep(s), concurrency %d per server, ", r.Options.Reps, r.Options.Concurrency)
	}
	fmt.Fprintf(&b, "%d CPUs, %s, wall %.0fs, started %s (load %s)",
		r.Host.CPUs, r.Host.GoVersion, r.WallSeconds, r.Started.Format("2006-01-02 15:04 MST"), r.Host.Load)
	if r.Host.Revision != "" {
		fmt.Fprintf(&b, ", revision %s", r.Host.Revision)
	}
	b.WriteString("\n")
	if len(r.Rows) > 0 {
		b.WriteString("\n")
		r.writeRows(&b)
	}
	if r.Memory != nil {
		b.WriteString("\n")
		r.Memory.writeTable(&b)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func (r *Report) writeRows(b *strings.Builder) {
	b.WriteString("| workload | configuration | N | tasks/s | ÷ bare | overhead p50 / p99 (µs) | CPU µs/task: Go + Redis + PG = total | CPU ÷ bare | requests per commit |\n")
	b.WriteString("|---|---|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, row := range r.Rows {
		ratio, cpuRatio := rng(row.ThroughputRatio, "%.2f"), rng(row.CPURatio, "%.2f")
		if row.Config == ConfigBare {
			ratio, cpuRatio = "1", "1"
		}
		perCommit := "-"
		if row.RowsPerCommit.Median > 0 {
			perCommit = fmt.Sprintf("%.1f", row.RowsPerCommit.Median)
		}
		errs := ""
		if row.Errors > 0 {
			errs = fmt.Sprintf(" (%d errors)", row.Errors)
		}
		fmt.Fprintf(b, "| %s | %s %s%s | %.0f | %s | %s | %.0f / %.0f | %.0f + %.0f + %.0f = %.0f | %s | %s |\n",
			r.workloadLabel(row), row.Config, row.Name, errs, row.N.Median, rng(row.TasksPerSecond, "%.0f"), ratio,
			row.OverheadP50us.Median, row.OverheadP99us.Median,
			row.CPUGo.Median, row.CPURedis.Median, row.CPUPostgres.Median, row.CPUTotal.Median, cpuRatio, perCommit)
	}
}

// WriteJSON writes the whole report, every sample included.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// writeTable prints memory mode's results as a Markdown table (MiB = 2^20 bytes).
func (m *MemoryReport) writeTable(b *strings.Builder) {
	fmt.Fprintf(b, "Memory: one process per configuration, %d no-op tasks at concurrency %d (full stack: %d Postgres connections); warm-up: the %s\n\n",
		m.Tasks, m.Concurrency, m.PoolPerServer, m.Warmup)
	b.WriteString("| configuration | tasks/s | RSS ready | RSS after warm-up | RSS end | peak RSS (VmHWM) | peak ÷ bare | RSS slope (KiB/1000 tasks): after warm-up / second half | live heap after warm-up → end | live heap slope (KiB/1000 tasks) | Go heap at end: in use / live after GC | goroutines |\n")
	b.WriteString("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, r := range m.Results {
		ratio := "–"
		if r.PeakRatio > 0 {
			ratio = fmt.Sprintf("%.2f", r.PeakRatio)
		}
		errs := ""
		if r.Errors > 0 {
			errs = fmt.Sprintf(" (%d errors)", r.Errors)
		}
		fmt.Fprintf(b, "| %s %s%s | %.0f | %s | %s | %s | %s | %s | %+.1f / %+.1f | %s → %s | %+.1f | %s / %s | %d |\n",
			r.Config, r.Name, errs, r.TasksPerSecond, mib(r.RSSReady), mib(r.RSSWarm), mib(r.RSSEnd), mib(r.PeakRSS), ratio,
			r.RSSSlope/1024, r.RSSSlopeLate/1024, mib(int64(r.LiveHeapWarm)), mib(int64(r.LiveHeapEnd)), r.LiveHeapSlope/1024,
			mib(int64(r.GoHeap.HeapInuse)), mib(int64(r.GoHeap.LiveHeapAfterGC)), r.GoHeap.Goroutines)
	}
}

// WriteSVG draws throughput as a ratio to bare asynq: one bar per configuration (the
// median), a whisker from the minimum to the maximum, the median tasks/s beside it.
//
// A memory-mode report draws each configuration's RSS against tasks processed instead.
func (r *Report) WriteSVG(w io.Writer) error {
	if len(r.Rows) == 0 && r.Memory != nil {
		return r.Memory.writeSVG(w, r.Started.Format("2006-01-02"))
	}
	const (
		left, barW, right = 330, 420, 150
		rowH, top         = 22, 58
		width             = left + barW + right
	)
	maxRatio := 1.0
	for _, row := range r.Rows {
		maxRatio = max(maxRatio, row.ThroughputRatio.Max)
	}
	scale := float64(barW) / maxRatio
	var b strings.Builder
	y := top
	var body strings.Builder
	prev := ""
	for _, row := range r.Rows {
		label := r.workloadLabel(row)
		if label != prev {
			if prev != "" {
				y += 8
			}
			fmt.Fprintf(&body, `<text x="8" y="%d" font-weight="bold">%s</text>`+"\n", y+15, html.EscapeString(label))
			y += rowH
			prev = label
		}
		fill := "#4e79a7"
		switch row.Config {
		case ConfigBare:
			fill = "#9c9c9c"
		case ConfigLock:
			fill = "#f28e2b"
		case ConfigFull, ConfigFullTx:
			fill = "#e15759"
		}
		m := row.ThroughputRatio.Median
		if row.Config == ConfigBare {
			m = 1
		}
		fmt.Fprintf(&body, `<text x="24" y="%d">%s %s</text>`+"\n", y+15, row.Config, html.EscapeString(row.Name))
		fmt.Fprintf(&body, `<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s"/>`+"\n", left, y+3, m*scale, rowH-6, fill)
		if row.Config != ConfigBare && row.Reps > 1 {
			x1, x2, cy := float64(left)+row.ThroughputRatio.Min*scale, float64(left)+row.ThroughputRatio.Max*scale, y+rowH/2
			fmt.Fprintf(&body, `<path d="M%.1f %dH%.1fM%.1f %dv8M%.1f %dv8" stroke="#222" fill="none"/>`+"\n", x1, cy, x2, x1, cy-4, x2, cy-4)
		}
		fmt.Fprintf(&body, `<text x="%d" y="%d">%.2f× · %.0f/s</text>`+"\n", left+barW+6, y+15, m, row.TasksPerSecond.Median)
		y += rowH
	}
	height := y + 30
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="13">`+"\n", width, height, width, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="#fff"/>`+"\n")
	fmt.Fprintf(&b, `<text x="8" y="20" font-size="15" font-weight="bold">Throughput ÷ bare asynq, same repetition (median, whisker min–max of %d reps)</text>`+"\n", r.Options.Reps)
	fmt.Fprintf(&b, `<text x="8" y="40" fill="#555">concurrency %d per server, %d CPUs shared with Redis and Postgres, %s</text>`+"\n", r.Options.Concurrency, r.Host.CPUs, r.Started.Format("2006-01-02"))
	for _, t := range []float64{0, 0.25, 0.5, 0.75, 1} {
		if t > maxRatio {
			break
		}
		x := float64(left) + t*scale
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#ddd"/>`+"\n", x, top, x, y)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle" fill="#555">%.2g</text>`+"\n", x, y+16, t)
	}
	b.WriteString(body.String())
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// writeSVG draws each configuration's resident set (MiB) against tasks processed, one
// line per configuration, its peak (VmHWM) as a dashed line.
func (m *MemoryReport) writeSVG(w io.Writer, date string) error {
	const (
		left, top, plotW, plotH = 70, 50, 640, 320
		width, height           = left + plotW + 200, top + plotH + 50
	)
	maxRSS := int64(1)
	for _, r := range m.Results {
		maxRSS = max(maxRSS, r.PeakRSS)
		for _, s := range r.Samples {
			maxRSS = max(maxRSS, s.RSS)
		}
	}
	yMax := float64(maxRSS) / (1 << 20) * 1.1
	x := func(tasks int64) float64 { return left + float64(tasks)/float64(max(m.Tasks, 1))*plotW }
	y := func(bytes int64) float64 { return top + plotH - float64(bytes)/(1<<20)/yMax*plotH }
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="13">`+"\n", width, height, width, height)
	b.WriteString(`<rect width="100%" height="100%" fill="#fff"/>` + "\n")
	fmt.Fprintf(&b, `<text x="8" y="20" font-size="15" font-weight="bold">Worker RSS (MiB) against tasks processed, one process per configuration</text>`+"\n")
	fmt.Fprintf(&b, `<text x="8" y="40" fill="#555">%d no-op tasks, concurrency %d, dashed: peak (VmHWM), %s</text>`+"\n", m.Tasks, m.Concurrency, date)
	for i := 0; i <= 4; i++ {
		v := yMax * float64(i) / 4
		yy := top + plotH - float64(i)/4*plotH
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/><text x="%d" y="%.1f" text-anchor="end" fill="#555">%.0f</text>`+"\n", left, yy, left+plotW, yy, left-6, yy+4, v)
		xx := left + float64(i)/4*plotW
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle" fill="#555">%d</text>`+"\n", xx, top+plotH+18, m.Tasks*i/4)
	}
	fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="middle" fill="#555">tasks processed</text>`+"\n", left+plotW/2, top+plotH+38)
	colors := map[string]string{ConfigBare: "#9c9c9c", ConfigFull: "#e15759", ConfigFullTx: "#4e79a7"}
	for i, r := range m.Results {
		c := colors[r.Config]
		var path strings.Builder
		for j, s := range r.Samples {
			cmd := "L"
			if j == 0 {
				cmd = "M"
			}
			fmt.Fprintf(&path, "%s%.1f %.1f", cmd, x(s.Tasks), y(s.RSS))
		}
		fmt.Fprintf(&b, `<path d="%s" stroke="%s" stroke-width="1.5" fill="none"/>`+"\n", path.String(), c)
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="%s" stroke-dasharray="4 3"/>`+"\n", left, y(r.PeakRSS), left+plotW, y(r.PeakRSS), c)
		fmt.Fprintf(&b, `<text x="%d" y="%d" fill="%s">%s %s: peak %.0f MiB</text>`+"\n", left+plotW+10, top+15+18*i, c, r.Config, html.EscapeString(r.Name), float64(r.PeakRSS)/(1<<20))
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}
