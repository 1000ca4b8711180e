//go:build faults

package faults

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/localserver"
	"github.com/idemq/idemq/internal/release"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// The mixed run's phases, as shares of the nemesis: the migration, then this build's api
// and two workers beside the previous release's; then the rollback of those two workers
// to the previous release.
const (
	mixedMigrateAt  = 0.15
	mixedRollbackAt = 0.6
)

// runMixed is a rolling upgrade and a rollback under the nemesis: the previous release's
// (the newest in RELEASES, built from the repository's history by testenv.ReleaseBinary)
// api and two workers run on its schema; this build's migration is applied while they
// serve; this build's api and two workers join them; then those two workers are rolled
// back to the previous release. The workload holds charges and debits only (the previous
// release has no checkouts), and the checker is the main runs'.
func runMixed(t *testing.T, p profile, seed uint64) runReport {
	began := time.Now()
	rs := release.List()
	old := testenv.ReleaseBinary(t, rs[len(rs)-1])
	hist := newHistory()
	c := startCluster(t, clusterConfig{mode: localserver.PersistNone, workers: 4, honorKeys: true, previous: old, startAfter: 2,
		workerEnv:   []string{"IDEMQ_UNSAFE_FAULTS=" + faultPoints},
		workerEnvAt: map[int][]string{0: {"IDEMQ_UNSAFE_FAULTS=" + quickFaultPoints, "IDEMQ_CONCURRENCY=8"}}}, hist)
	ctx, cancel := context.WithTimeout(context.Background(), p.nemesis+p.drain+5*time.Minute)
	defer cancel()
	jobs := plan(seed, p.jobs, p.spread)
	for i, j := range jobs {
		if co := j.checkout; co != nil {
			jobs[i].checkout = nil
			jobs[i].charge = &tasks.Charge{OrderID: co.OrderID, CustomerID: co.CustomerID, AmountCents: co.AmountCents, Currency: co.Currency}
		}
	}

	var phaseErrs []string
	phasesDone := make(chan struct{})
	go func() {
		defer close(phasesDone)
		if err := c.upgrade(ctx, began.Add(time.Duration(float64(p.nemesis)*mixedMigrateAt))); err != nil {
			phaseErrs = append(phaseErrs, "upgrade: "+err.Error())
			return
		}
		if err := c.rollback(ctx, old, began.Add(time.Duration(float64(p.nemesis)*mixedRollbackAt))); err != nil {
			phaseErrs = append(phaseErrs, "rollback: "+err.Error())
		}
	}()
	nemesisDone := make(chan struct{})
	go func() {
		defer close(nemesisDone)
		c.runNemesis(ctx, seed, p.nemesis)
	}()
	driveErr := c.drive(ctx, jobs)
	<-nemesisDone
	<-phasesDone
	c.heal()
	hist.note("heal", "", "")
	t.Logf("mixed: nemesis over after %s; healed", time.Since(began).Round(time.Second))
	healed := time.Now()
	r := runReport{Mode: "mixed", Postgres: pgSingle, NemesisS: p.nemesis.Seconds()}
	v := c.settle(ctx, p, hist, &r, began, healed)
	// Which release took the charges: this build sends its fence to the provider, the
	// previous release does not.
	var oldCharges, newCharges int
	if err := c.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE fence IS NULL), count(*) FILTER (WHERE fence IS NOT NULL)
		FROM fakepay_requests`).Scan(&oldCharges, &newCharges); err != nil {
		t.Fatalf("checker: provider requests by release: %v", err)
	}
	r.Counters["mixed:provider_requests_previous"], r.Counters["mixed:provider_requests_this"] = float64(oldCharges), float64(newCharges)

	r.checkShared(p, driveErr, c.faultKinds())
	r.fail(len(phaseErrs) == 0, "%s", strings.Join(phaseErrs, "; "))
	r.fail(oldCharges > 0 && newCharges > 0, "provider requests by the previous release %d, by this build %d: want both releases to have charged", oldCharges, newCharges)
	r.Pass = len(r.Failures) == 0
	if !r.Pass {
		t.Errorf("mixed: %s; examples: %v", strings.Join(r.Failures, "; "), v.Examples)
	}
	return r
}

// upgrade, at the time at: applies this build's migrations while the previous release
// serves (again until they apply: the nemesis may have Postgres down), restarts the
// provider stand-in as this build's, and starts this build's api and the parked workers.
func (c *cluster) upgrade(ctx context.Context, at time.Time) error {
	sleepUntil(ctx, at)
	if err := retry(ctx, 90*time.Second, func() error {
		out, err := runIdemq([]string{"DATABASE_URL=" + c.dbURL}, "migrate")
		if err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	}); err != nil {
		return fmt.Errorf("idemq migrate: %w", err)
	}
	c.hist.note("migrate", "", "this build's migrations applied while the previous release serves")
	// fakepay is the provider, not part of a release: this build's records the fence that
	// this build's workers send.
	if done := c.fakepay.signal(syscall.SIGTERM, true); done != nil {
		<-done
	}
	c.fakepay.mu.Lock()
	c.fakepay.exe = ""
	c.fakepay.mu.Unlock()
	if err := c.fakepay.start(); err != nil {
		return err
	}
	apiPort, _ := localserver.FreePort()
	url := fmt.Sprintf("http://127.0.0.1:%d", apiPort)
	env := append([]string{fmt.Sprintf("IDEMQ_HTTP_ADDR=127.0.0.1:%d", apiPort)}, c.api.env[:2]...) // DATABASE_URL, REDIS_URL
	api := &proc{name: "api-new", args: []string{"api"}, log: filepath.Join(c.dir, "api-new.log"), env: append(env, "IDEMQ_RECONCILE_GRACE=20s")}
	if err := api.start(); err != nil {
		return err
	}
	c.extra = append(c.extra, api)
	if err := waitHTTP(ctx, url+"/healthz", 30*time.Second); err != nil {
		return fmt.Errorf("this build's api: %w", err)
	}
	c.apis.Store(&[]string{c.apiURL, url})
	for _, w := range c.workers {
		w.mu.Lock()
		parked := w.parked
		w.parked = false
		w.mu.Unlock()
		if parked {
			c.startWorker(w)
		}
	}
	c.hist.note("upgrade", "", "this build's api and workers run beside the previous release's")
	return nil
}

// rollback, at the time at: this build's workers are stopped (SIGTERM) and started again
// as the previous release (old); the slots run it from then on, through the nemesis'
// restarts too.
func (c *cluster) rollback(ctx context.Context, old string, at time.Time) error {
	sleepUntil(ctx, at)
	for _, w := range c.workers {
		w.mu.Lock()
		isNew := w.exe == ""
		w.exe = old
		w.mu.Unlock()
		if !isNew {
			continue
		}
		w.scrape()
		if done := w.signal(syscall.SIGTERM, true); done != nil {
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				w.signal(syscall.SIGKILL, true)
				<-done
			}
		}
		c.startWorker(w)
	}
	c.hist.note("rollback", "", "this build's workers rolled back to the previous release")
	return ctx.Err()
}

func sleepUntil(ctx context.Context, at time.Time) {
	select {
	case <-time.After(time.Until(at)):
	case <-ctx.Done():
	}
}

// waitHTTP waits up to d for url to answer 200.
func waitHTTP(ctx context.Context, url string, d time.Duration) error {
	return retry(ctx, d, func() error {
		resp, err := http.Get(url)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET %s: %d", url, resp.StatusCode)
		}
		return nil
	})
}

// mixedRun says whether the profile runs the mixed-version run: the long one, or any
// with IDEMQ_FAULTS_MIXED=1.
func mixedRun(p profile) bool { return p.name == "long" || os.Getenv("IDEMQ_FAULTS_MIXED") == "1" }
