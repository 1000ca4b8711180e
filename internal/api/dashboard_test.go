package api

import (
	"encoding/base64"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

func basic(user, pass string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+pass))
}

// publish records and publishes a charge through the Client, so Redis has the queue.
func (a *testAPI) publish(t *testing.T, order string) {
	t.Helper()
	spec, err := tasks.ChargeSpec(tasks.Charge{OrderID: order, CustomerID: "c-1", AmountCents: 1999, Currency: "EUR"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.client.Enqueue(testenv.Context(t, 10*time.Second), spec); err != nil {
		t.Fatal(err)
	}
	// Enqueue leaves a failed publish to the relay (newTestAPI runs one): wait for Redis.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := a.s.insp.GetTaskInfo(tasks.Queue, spec.Key); err == nil {
			return
		} else if time.Now().After(deadline) {
			t.Fatalf("%s never reached Redis: %v", spec.Key, err)
		}
	}
}

func TestDashboardAuthAndReadOnly(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, &Options{DashboardUser: "ops", DashboardPassword: "s3cret"})
	a.publish(t, "o-1")
	good := basic("ops", "s3cret")

	for _, path := range []string{"/monitoring/", "/monitoring/api/queues", "/ledger/", "/ledger/charge:o-1"} {
		for _, auth := range []string{"", basic("ops", "wrong"), basic("other", "s3cret"), basic("ops", "s3cret ")} {
			ans := a.do(t, "GET", path, "", "Authorization", auth)
			if auth == "" {
				ans = a.do(t, "GET", path, "")
			}
			ans.wantError(t, 401, "authentication required")
			if !strings.HasPrefix(ans.header.Get("WWW-Authenticate"), "Basic ") {
				t.Fatalf("%s: 401 without a Basic challenge", path)
			}
		}
	}
	// The API itself is not behind the dashboard's auth.
	a.do(t, "GET", "/v1/jobs/charge:o-1", "").want(t, 200)
	a.do(t, "GET", "/healthz", "").want(t, 200)

	a.do(t, "GET", "/monitoring/", "", "Authorization", good).want(t, 200, `<div id="root">`, `window.FLAG_ROOT_PATH="\/monitoring"`, `window.FLAG_READ_ONLY="true"`)
	a.do(t, "GET", "/monitoring/queues/default", "", "Authorization", good).want(t, 200, `<div id="root">`)
	a.do(t, "GET", "/monitoring/api/queues", "", "Authorization", good).want(t, 200, `"queue":"default"`, `"size":1`)
	a.do(t, "GET", "/monitoring/api/queues/default/pending_tasks", "", "Authorization", good).want(t, 200, `"id":"charge:o-1"`, `"type":"payment:charge"`)
	a.do(t, "GET", "/monitoring/api/queues/default/tasks/charge:o-1", "", "Authorization", good).want(t, 200, `"id":"charge:o-1"`, `"state":"pending"`)
	a.do(t, "GET", "/monitoring/api/redis_info", "", "Authorization", good).want(t, 200, `"redis_version"`)
	a.do(t, "GET", "/monitoring/api/queue_stats", "", "Authorization", good).want(t, 200, `"default"`)
	a.do(t, "GET", "/monitoring/api/servers", "", "Authorization", good).want(t, 200)
	// Read-only: every action is refused, and the task is still there.
	a.do(t, "POST", "/monitoring/api/queues/default:pause", "", "Authorization", good).want(t, 405, "read-only")
	a.do(t, "DELETE", "/monitoring/api/queues/default/pending_tasks/charge:o-1", "", "Authorization", good).want(t, 405)
	a.do(t, "POST", "/monitoring/api/queues/default/pending_tasks/charge:o-1:archive", "", "Authorization", good).want(t, 405)
	a.do(t, "GET", "/monitoring/api/queues/default", "", "Authorization", good).want(t, 200, `"paused":false`, `"pending":1`)
}

func TestDashboardActionsWhenAllowed(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, &Options{DashboardActions: true})
	a.publish(t, "o-1")
	a.do(t, "GET", "/monitoring/", "").want(t, 200, `window.FLAG_READ_ONLY="false"`)
	a.do(t, "POST", "/monitoring/api/queues/default:pause", "").want(t, 204)
	a.do(t, "GET", "/monitoring/api/queues/default", "").want(t, 200, `"paused":true`)
}
