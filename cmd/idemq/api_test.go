package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/internal/testenv"
)

// TestAPICommand runs `idemq api` as a process: it accepts a charge, its relay publishes
// the task under TaskID = key, the dashboard asks for its password, and SIGTERM stops it
// cleanly.
func TestAPICommand(t *testing.T) {
	t.Parallel()
	rurl := testenv.RedisURL(t)
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	a := startAPIProc(t, addr, addr, rurl, "IDEMQ_DASHBOARD_USER=ops", "IDEMQ_DASHBOARD_PASSWORD=pw")
	base, get, stderr, cmd, exited := a.base, a.get, a.stderr, a.cmd, a.exited

	resp, err := http.Post(base+"/v1/charges", "application/json",
		strings.NewReader(`{"order_id":"o-1","customer_id":"c-1","amount_cents":1999,"currency":"EUR"}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 202 || !strings.Contains(string(body), `"key":"charge:o-1"`) {
		t.Fatalf("POST /v1/charges: %d %s", resp.StatusCode, body)
	}
	if code, body := get("/v1/jobs/charge:o-1"); code != 200 || !strings.Contains(body, `"status":"accepted"`) {
		t.Fatalf("GET /v1/jobs/charge:o-1: %d %s", code, body)
	}
	if code, _ := get("/monitoring/"); code != 401 {
		t.Fatalf("/monitoring/ without a password: %d, want 401", code)
	}
	if code, body := get("/metrics"); code != 200 || !strings.Contains(body, `idemq_api_requests_total{code="202",route="POST /v1/charges"} 1`) {
		t.Fatalf("/metrics: %d, no count of the accepted charge", code)
	}

	// The api's relay publishes the intent under TaskID = key.
	opt, err := asynq.ParseRedisURI(rurl)
	if err != nil {
		t.Fatal(err)
	}
	insp := asynq.NewInspector(opt)
	defer insp.Close()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if info, err := insp.GetTaskInfo("default", "charge:o-1"); err == nil && info.Type == "payment:charge" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the relay never published charge:o-1:\n%s", stderr.String())
		}
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("idemq api after SIGTERM: %v\n%s", err, stderr.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("idemq api did not stop within 20s of SIGTERM:\n%s", stderr.String())
	}
	exited <- nil // for the cleanup
}

// TestAPIDashboardWithoutPassword runs `idemq api` on all interfaces with the password
// compose.yaml falls back on: it says at start that the dashboard and the ledger page
// answer 403, they do, and the API and the health endpoints are served.
func TestAPIDashboardWithoutPassword(t *testing.T) {
	t.Parallel()
	port := testenv.FreePort(t)
	a := startAPIProc(t, fmt.Sprintf(":%d", port), fmt.Sprintf("127.0.0.1:%d", port), testenv.RedisURL(t),
		"IDEMQ_DASHBOARD_PASSWORD=change-me")
	get, stderr := a.get, a.stderr
	for _, path := range []string{"/monitoring/", "/ledger/", "/ledger/charge:o-1"} {
		if code, body := get(path); code != 403 || !strings.Contains(body, "IDEMQ_DASHBOARD_PASSWORD") {
			t.Errorf("%s: %d %s, want 403 naming IDEMQ_DASHBOARD_PASSWORD", path, code, body)
		}
	}
	for _, path := range []string{"/healthz", "/metrics"} {
		if code, _ := get(path); code != 200 {
			t.Errorf("%s: %d, want 200", path, code)
		}
	}
	if code, body := get("/v1/jobs/charge:o-1"); code != 403 || !strings.Contains(body, "set IDEMQ_API_TOKEN") {
		t.Errorf("/v1/jobs/charge:o-1: %d %s, want 403 naming IDEMQ_API_TOKEN", code, body)
	}
	if log := stderr.String(); !strings.Contains(log, "/monitoring/, /ledger/ and /schedule/ answer 403 until IDEMQ_DASHBOARD_USER and IDEMQ_DASHBOARD_PASSWORD are set") {
		t.Errorf("no start-up line about the dashboard's 403:\n%s", log)
	}
	if log := stderr.String(); !strings.Contains(log, "/v1/ answers 403 until a token is set") {
		t.Errorf("no start-up line about the API's 403:\n%s", log)
	}
}

// apiProc is an `idemq api` process of a test.
type apiProc struct {
	cmd    *exec.Cmd
	exited chan error // the process's exit; the cleanup reads it
	stderr *testenv.LogBuffer
	base   string // http://dial
}

// startAPIProc runs `idemq api` listening on listen, on a fresh schema and on the Redis at
// redisURL, with env added, and waits until /readyz at dial answers 200. The process is
// killed when the test ends.
func startAPIProc(t *testing.T, listen, dial, redisURL string, env ...string) *apiProc {
	t.Helper()
	a := &apiProc{cmd: exec.Command(binary, "api"), exited: make(chan error, 1), stderr: &testenv.LogBuffer{}, base: "http://" + dial}
	a.cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "DATABASE_URL=" + testenv.PostgresURL(t), "REDIS_URL=" + redisURL,
		"IDEMQ_HTTP_ADDR=" + listen, "IDEMQ_LOG_LEVEL=warn"}, env...)
	a.cmd.Stderr = a.stderr
	if err := a.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { a.exited <- a.cmd.Wait() }()
	t.Cleanup(func() {
		a.cmd.Process.Kill()
		<-a.exited
	})
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if code, _ := a.get("/readyz"); code == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("idemq api never became ready:\n%s", a.stderr.String())
		}
	}
	return a
}

// get fetches path: the status and the body (the error's text, status 0, when the
// request fails).
func (a *apiProc) get(path string) (int, string) {
	resp, err := http.Get(a.base + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}
