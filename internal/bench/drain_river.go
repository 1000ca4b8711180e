package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
)

// riverResult is riverdrain's JSON line.
type riverResult struct {
	Deliveries int     `json:"deliveries"`
	Seconds    float64 `json:"seconds"`
	PerSecond  float64 `json:"per_second"`
	CPUUserSys float64 `json:"cpu_user_sys_seconds"`
	Effects    int     `json:"effects"`
}

// drainRiver measures River on one workload: riverdrain (cfg.binary) inserts keys debits
// as River jobs into this run's schema, then, on the bench's word, drains them at
// concurrency conc. Its clock runs from the first job fetched to the last completed; the
// CPU of its process, Postgres's and the WAL are read around the drain as for the others
// (riverdrain's connections carry this run's application_name and stay open until the
// bench has read them).
func (e *env) drainRiver(ctx context.Context, opt Options, w drainWorkload, keys, conc int, cfg drainConfig, rep int) (DrainSample, error) {
	s := DrainSample{Workload: w.name, Concurrency: conc, Config: cfg.name, Rep: rep + 1, Keys: keys, Deliveries: keys}
	if err := e.reset(ctx); err != nil {
		return s, err
	}
	prefix := fmt.Sprintf("r%d%s", rep, randomHex(3))
	ctx, cancel := context.WithTimeout(ctx, opt.DrainTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, cfg.binary, "-wait", "-n", strconv.Itoa(keys), "-concurrency", strconv.Itoa(conc),
		"-accounts", strconv.Itoa(riverAccounts[w.name]), "-prefix", prefix)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+e.dsn)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return s, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return s, err
	}
	if err := cmd.Start(); err != nil {
		return s, fmt.Errorf("bench: start %s: %w", cfg.binary, err)
	}
	waited := false
	wait := func() error { // riverdrain exits once its stdin closes
		if waited {
			return nil
		}
		waited = true
		stdin.Close()
		return cmd.Wait()
	}
	defer wait()
	fail := func(err error) (DrainSample, error) {
		wait()
		return s, fmt.Errorf("bench: drain %s river c=%d: %w\n%s", w.name, conc, err, strings.TrimSpace(stderr.String()))
	}
	out := bufio.NewReader(stdout)
	if line, err := out.ReadString('\n'); err != nil || line != "ready\n" {
		return fail(fmt.Errorf("riverdrain did not get ready (%q, %v)", line, err))
	}
	wal0 := e.walLSN(ctx)
	cpu0 := e.probe.snap(ctx)
	if _, err := stdin.Write([]byte("go\n")); err != nil {
		return fail(err)
	}
	line, err := out.ReadBytes('\n')
	if err != nil {
		return fail(err)
	}
	cpu1 := e.probe.snap(ctx)
	wal1 := e.walLSN(ctx)
	var r riverResult
	if err := json.Unmarshal(line, &r); err != nil {
		return fail(fmt.Errorf("riverdrain's result %q: %w", line, err))
	}
	s.Seconds, s.PerSecond = r.Seconds, r.PerSecond
	d := cpu0.to(cpu1)
	per := 1e6 / float64(s.Deliveries)
	s.CPUWorkers, s.CPURedis, s.CPUPG = r.CPUUserSys*per, d.redis*per, d.pg*per
	if wal0 != "" && wal1 != "" {
		var bytes float64
		if err := e.admin.QueryRow(ctx, `SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::float8`, wal1, wal0).Scan(&bytes); err == nil {
			s.WALBytes = bytes / float64(s.Deliveries)
		}
	}
	if err := e.admin.QueryRow(ctx, `SELECT count(*) FROM wallet_entries WHERE reference LIKE $1`, prefix+"-%").Scan(&s.Effects); err != nil {
		return s, fmt.Errorf("bench: count effects: %w", err)
	}
	if s.Effects != keys || r.Effects != keys || r.Deliveries != keys {
		return fail(fmt.Errorf("%d effects, riverdrain says %d of %d (want %d)", s.Effects, r.Effects, r.Deliveries, keys))
	}
	if err := wait(); err != nil {
		return fail(err)
	}
	return s, nil
}

// buildRiverdrain builds riverdrain from internal/bench/river (run from the repository
// root) into a temporary directory and returns its path.
func buildRiverdrain(ctx context.Context) (string, error) {
	src := filepath.Join("internal", "bench", "river")
	if _, err := os.Stat(filepath.Join(src, "go.mod")); err != nil {
		return "", fmt.Errorf("bench: -drain-river build: run from the repository root (%w)", err)
	}
	dir, err := os.MkdirTemp("", "riverdrain")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "riverdrain")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, ".")
	cmd.Dir = src
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("bench: build riverdrain: %w\n%s", err, out)
	}
	return bin, nil
}
