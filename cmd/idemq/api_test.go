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
	dsn, rurl := testenv.PostgresURL(t), testenv.RedisURL(t)
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	cmd := exec.Command(binary, "api")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "DATABASE_URL=" + dsn, "REDIS_URL=" + rurl,
		"IDEMQ_HTTP_ADDR=" + addr, "IDEMQ_DASHBOARD_USER=ops", "IDEMQ_DASHBOARD_PASSWORD=pw", "IDEMQ_LOG_LEVEL=warn"}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-exited
	})
	base := "http://" + addr
	get := func(path string) (int, string) {
		resp, err := http.Get(base + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if code, _ := get("/readyz"); code == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("idemq api never became ready:\n%s", stderr.String())
		}
	}

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
