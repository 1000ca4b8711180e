package main

import (
	"bufio"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// proc is an idemq process started by a test, stopped when the test ends.
type proc struct {
	t    *testing.T
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
}

// startIdemq starts `idemq args...` with env added to a clean environment.
func startIdemq(t *testing.T, name string, env []string, args ...string) *proc {
	t.Helper()
	return startBinary(t, binary, name, env, args...)
}

// startBinary is startIdemq with another idemq binary (an earlier release's).
func startBinary(t *testing.T, binary, name string, env []string, args ...string) *proc {
	t.Helper()
	log := filepath.Join(t.TempDir(), name+".log")
	f, err := os.Create(log)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(binary, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{t: t, name: name, cmd: cmd, log: log, done: make(chan struct{})}
	go func() { cmd.Wait(); f.Close(); close(p.done) }()
	t.Cleanup(func() {
		p.signal(syscall.SIGKILL)
		<-p.done
		if t.Failed() {
			t.Logf("--- %s log (tail) ---\n%s", name, p.tail(3000))
		}
	})
	return p
}

func (p *proc) signal(sig syscall.Signal) { p.cmd.Process.Signal(sig) }

func (p *proc) tail(n int) string {
	b, _ := os.ReadFile(p.log)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// metricSum adds up the samples of a counter whose labels contain every one of match.
func metricSum(t *testing.T, url, name string, match ...string) float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name+"{") {
			continue
		}
		ok := true
		for _, m := range match {
			ok = ok && strings.Contains(line, m)
		}
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err == nil {
			sum += v
		}
	}
	return sum
}

// stack is fakepay plus worker processes on a private schema and Redis database.
type stack struct {
	dsn, redisURL, fakepayURL string
	pool                      *pgxpool.Pool
	client                    *asynq.Client
	insp                      *asynq.Inspector
	fakepay                   *proc
	workers                   []*proc
	metrics                   []string
	workerEnv                 []string
}

// stackSlot lets one test at a time run a stack of processes: each opens tens of Postgres
// connections (a worker's pool is IDEMQ_CONCURRENCY + 4, plus heartbeats and the relay),
// and the shared test server allows 100.
var stackSlot = make(chan struct{}, 1)

// takeStackSlot waits for the slot and gives it back when the test ends, after its
// processes are gone (cleanups run last-registered first).
func takeStackSlot(t *testing.T) {
	t.Helper()
	stackSlot <- struct{}{}
	t.Cleanup(func() { <-stackSlot })
}

func startStack(t *testing.T, workers int, fakepayEnv, workerEnv []string) *stack {
	t.Helper()
	takeStackSlot(t)
	redisURL := testenv.RedisURL(t)
	return startStackOn(t, workers, redisURL, testenv.RedisClient(t, redisURL), fakepayEnv, workerEnv)
}

// startStackOn is startStack on the Redis at redisURL, which rdb is a client of (the
// caller holds the stack slot).
func startStackOn(t *testing.T, workers int, redisURL string, rdb redis.UniversalClient, fakepayEnv, workerEnv []string) *stack {
	t.Helper()
	dsn := testenv.PostgresURL(t)
	return startStackDB(t, workers, redisURL, rdb, dsn, dsn, fakepayEnv, workerEnv)
}

// startStackDB is startStackOn with the workers on the migrated database dsn and fakepay
// on fakepayDSN (a provider keeps its own database).
func startStackDB(t *testing.T, workers int, redisURL string, rdb redis.UniversalClient, dsn, fakepayDSN string, fakepayEnv, workerEnv []string) *stack {
	t.Helper()
	s := &stack{dsn: dsn, redisURL: redisURL}
	s.pool = testenv.Pool(t, s.dsn)
	s.client = asynq.NewClientFromRedisClient(rdb)
	s.insp = asynq.NewInspectorFromRedisClient(rdb)

	fp := testenv.FreePort(t)
	s.fakepayURL = fmt.Sprintf("http://127.0.0.1:%d", fp)
	s.fakepay = startIdemq(t, "fakepay", append([]string{"DATABASE_URL=" + fakepayDSN, fmt.Sprintf("IDEMQ_FAKEPAY_ADDR=127.0.0.1:%d", fp)}, fakepayEnv...), "fakepay")
	testenv.WaitHTTP(t, s.fakepayURL+"/healthz", 20*time.Second)

	s.workerEnv = append([]string{
		"DATABASE_URL=" + s.dsn, "REDIS_URL=" + s.redisURL, "IDEMQ_FAKEPAY_URL=" + s.fakepayURL,
		"IDEMQ_CONCURRENCY=10", "IDEMQ_LEASE=2s", "IDEMQ_LOCK_TTL=2s", "IDEMQ_SHUTDOWN_TIMEOUT=5s",
	}, workerEnv...)
	for i := range workers {
		s.startWorker(t, i)
	}
	return s
}

func (s *stack) startWorker(t *testing.T, i int) *proc {
	t.Helper()
	port := testenv.FreePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	w := startIdemq(t, fmt.Sprintf("worker%d", i), append([]string{fmt.Sprintf("IDEMQ_METRICS_ADDR=127.0.0.1:%d", port)}, s.workerEnv...), "worker")
	testenv.WaitHTTP(t, url+"/readyz", 30*time.Second)
	if i < len(s.workers) {
		s.workers[i], s.metrics[i] = w, url+"/metrics"
	} else {
		s.workers, s.metrics = append(s.workers, w), append(s.metrics, url+"/metrics")
	}
	return w
}

// sum adds a counter up across the workers still answering.
func (s *stack) sum(t *testing.T, name string, match ...string) float64 {
	var total float64
	for _, m := range s.metrics {
		total += metricSum(t, m, name, match...)
	}
	return total
}

// waitLedger waits until n rows are completed, or fails after d.
func (s *stack) waitCompleted(t *testing.T, n int, d time.Duration) {
	t.Helper()
	ctx := testenv.Context(t, d+10*time.Second)
	deadline := time.Now().Add(d)
	var got int
	for time.Now().Before(deadline) {
		if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM processed_jobs WHERE status = 'completed'`).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got >= n {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatalf("%d of %d keys completed after %s", got, n, d)
}

func (s *stack) enqueue(t *testing.T, task *asynq.Task, opts ...asynq.Option) {
	t.Helper()
	if _, err := s.client.Enqueue(task, opts...); err != nil {
		t.Fatalf("enqueue: %v", err)
	}
}

func TestEndToEndDuplicatesTakeEffectOnce(t *testing.T) {
	t.Parallel()
	const orders, debits, copies = 300, 300, 3
	s := startStack(t, 3, []string{"IDEMQ_FAKEPAY_HONOR_KEYS=false"}, nil)
	start := time.Now()

	for i := range max(orders, debits) {
		for c := range copies {
			id := asynq.TaskID(fmt.Sprintf("copy%d-%d", c, i)) // a different TaskID per copy: all reach workers
			if i < orders {
				task, err := tasks.NewChargeTask(tasks.Charge{OrderID: fmt.Sprintf("o-%d", i), CustomerID: fmt.Sprintf("c-%d", i%30), AmountCents: int64(100 + i), Currency: "EUR"})
				if err != nil {
					t.Fatal(err)
				}
				s.enqueue(t, task, id)
			}
			if i < debits {
				task, err := tasks.NewDebitTask(tasks.Debit{AccountID: fmt.Sprintf("a-%d", i%30), AmountCents: int64(10 + i), Reference: fmt.Sprintf("r-%d", i)})
				if err != nil {
					t.Fatal(err)
				}
				s.enqueue(t, task, asynq.TaskID(fmt.Sprintf("d%d-%d", c, i)))
			}
		}
	}
	s.waitCompleted(t, orders+debits, 150*time.Second)
	// Every delivery ends: wait until no task is pending, active, scheduled or retrying.
	ctx := testenv.Context(t, 2*time.Minute)
	var q *asynq.QueueInfo
	for {
		var err error
		if q, err = s.insp.GetQueueInfo(tasks.Queue); err != nil {
			t.Fatal(err)
		}
		if q.Pending+q.Active+q.Scheduled+q.Retry == 0 || ctx.Err() != nil {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	elapsed := time.Since(start)

	var perOrder, perRef, charges, entries int
	s.pool.QueryRow(ctx, `SELECT coalesce(max(n), 0), coalesce(sum(n), 0) FROM (SELECT count(*) n FROM fakepay_charges GROUP BY order_id) x`).Scan(&perOrder, &charges)
	s.pool.QueryRow(ctx, `SELECT coalesce(max(n), 0), coalesce(sum(n), 0) FROM (SELECT count(*) n FROM wallet_entries GROUP BY reference) x`).Scan(&perRef, &entries)
	if charges != orders || perOrder != 1 {
		t.Errorf("fakepay charges = %d (max per order %d), want %d, one per order", charges, perOrder, orders)
	}
	if entries != debits || perRef != 1 {
		t.Errorf("wallet entries = %d (max per reference %d), want %d, one per reference", entries, perRef, debits)
	}
	var mismatched int
	s.pool.QueryRow(ctx, `SELECT count(*) FROM processed_jobs p
		LEFT JOIN fakepay_charges c ON c.id = p.result->>'charge_id'
		LEFT JOIN wallet_entries w ON w.id = (p.result->>'entry_id')::bigint
		WHERE c.id IS NULL AND w.id IS NULL`).Scan(&mismatched)
	if mismatched != 0 {
		t.Errorf("%d completed keys whose result names no existing charge or wallet entry", mismatched)
	}
	if q.Archived != 0 || q.Retry != 0 || q.FailedTotal != 0 {
		t.Errorf("asynq queue: archived %d, retry %d, failed %d; want 0 (busy must not count as a failure)", q.Archived, q.Retry, q.FailedTotal)
	}
	deliveries := q.ProcessedTotal
	hits := s.sum(t, "idemq_ledger_events_total", `event="cache_hit"`)
	ledgerBusy := s.sum(t, "idemq_ledger_events_total", `event="busy"`)
	lockBusy := s.sum(t, "idemq_lock_events_total", `event="busy"`)
	claimed := s.sum(t, "idemq_ledger_events_total", `event="claimed"`)
	t.Logf("e2e: %d jobs × %d copies in %s: %d deliveries processed; %v keys claimed; suppressed by the ledger (cached result) %v, busy retries: lock %v, ledger %v; charges per order %d, entries per reference %d",
		orders+debits, copies, elapsed.Round(time.Millisecond), deliveries, claimed, hits, lockBusy, ledgerBusy, perOrder, perRef)
	if int(hits) != (orders+debits)*(copies-1) {
		t.Errorf("cached-result answers = %v, want %d (every copy after the first)", hits, (orders+debits)*(copies-1))
	}
}

func TestEndToEndBadPayloadsAreArchivedWithReason(t *testing.T) {
	t.Parallel()
	s := startStack(t, 1, nil, nil)
	long := strings.Repeat("x", 300)
	bad := map[string]*asynq.Task{
		"malformed JSON":  asynq.NewTask(tasks.TypeCharge, []byte(`{"order_id":`)),
		"missing fields":  asynq.NewTask(tasks.TypeDebit, []byte(`{"account_id":"a"}`)),
		"negative amount": asynq.NewTask(tasks.TypeCharge, []byte(`{"order_id":"o","customer_id":"c","amount_cents":-1,"currency":"EUR"}`)),
		"300-byte key":    asynq.NewTask(tasks.TypeDebit, []byte(`{"account_id":"a","amount_cents":1,"reference":"`+long+`"}`)),
		"unknown field":   asynq.NewTask(tasks.TypeDebit, []byte(`{"account_id":"a","amount_cents":1,"reference":"r","extra":1}`)),
		"duplicate field": asynq.NewTask(tasks.TypeDebit, []byte(`{"account_id":"a","amount_cents":1,"reference":"dup2","reference":"dup3"}`)),
		"case variant":    asynq.NewTask(tasks.TypeDebit, []byte(`{"account_id":"a","amount_cents":1,"reference":"dup2","REFERENCE":"dup3"}`)),
		"amount over max": asynq.NewTask(tasks.TypeDebit, []byte(`{"account_id":"a","amount_cents":100000000000,"reference":"big"}`)),
		"huge amount":     asynq.NewTask(tasks.TypeCharge, []byte(`{"order_id":"o","customer_id":"c","amount_cents":9`+strings.Repeat("0", 30_000)+`,"currency":"EUR"}`)),
	}
	want := map[string]string{
		"malformed JSON": "malformed payload", "missing fields": "amount_cents", "negative amount": "amount_cents",
		"300-byte key": "the limit is", "unknown field": `unknown field "extra"`,
		"duplicate field": "reference: duplicate field", "case variant": "REFERENCE: field names are case-sensitive",
		"amount over max": "amount_cents: must be a positive whole number of cents, at most 99999999999, got 100000000000",
		"huge amount":     "at most 99999999999, got 900000000000000000000000… (30001 characters)",
	}
	for name, task := range bad {
		s.enqueue(t, task, asynq.TaskID("bad-"+strings.ReplaceAll(name, " ", "-")), asynq.MaxRetry(5))
	}
	// A type no handler serves is archived at once too, not retried 25 times.
	s.enqueue(t, asynq.NewTask("foo:bar", []byte(`{}`)), asynq.TaskID("unknown-type"), asynq.MaxRetry(25))
	ok, _ := tasks.NewDebitTask(tasks.Debit{AccountID: "a", AmountCents: 5, Reference: "good-after-bad"})
	s.enqueue(t, ok)
	s.waitCompleted(t, 1, 60*time.Second)

	deadline := time.Now().Add(60 * time.Second)
	var archived []*asynq.TaskInfo
	for time.Now().Before(deadline) {
		archived, _ = s.insp.ListArchivedTasks(tasks.Queue)
		if len(archived) == len(bad)+1 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if len(archived) != len(bad)+1 {
		var retrying []string
		if rs, err := s.insp.ListRetryTasks(tasks.Queue); err == nil {
			for _, r := range rs {
				retrying = append(retrying, fmt.Sprintf("%s (%s)", r.ID, r.LastErr))
			}
		}
		t.Fatalf("%d archived tasks, want %d; retrying: %q", len(archived), len(bad)+1, retrying)
	}
	for _, info := range archived {
		if info.ID == "unknown-type" {
			if !strings.Contains(info.LastErr, `unknown task type "foo:bar"`) || info.Retried != 0 {
				t.Errorf("foo:bar: archived after %d retries with %q; want no retry and the reason", info.Retried, info.LastErr)
			}
			continue
		}
		name := strings.ReplaceAll(strings.TrimPrefix(info.ID, "bad-"), "-", " ")
		if !strings.Contains(info.LastErr, want[name]) || !strings.Contains(info.LastErr, "bad payload") || info.Retried != 0 {
			t.Errorf("%s: archived after %d retries with %q; want no retry and a reason containing %q", name, info.Retried, info.LastErr, want[name])
		}
	}
	var rows int
	s.pool.QueryRow(testenv.Context(t, 5*time.Second), `SELECT count(*) FROM processed_jobs`).Scan(&rows)
	if rows != 1 {
		t.Errorf("ledger rows = %d, want 1 (bad payloads leave none)", rows)
	}
}

// holdAnswers is a proxy in front of the provider that holds each answer for hold after the
// provider has answered: the effect exists, the worker has not heard of it yet.
func holdAnswers(t *testing.T, target string, hold time.Duration) string {
	t.Helper()
	u, _ := url.Parse(target)
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.ModifyResponse = func(*http.Response) error { time.Sleep(hold); return nil }
	srv := httptest.NewServer(rp)
	t.Cleanup(srv.Close)
	return srv.URL
}

func TestEndToEndWorkerKilledMidCharge(t *testing.T) {
	t.Parallel()
	// A charge's call must end before its lease's self-fence deadline, less the margin
	// (about 0.8 of the lease): 8 s leaves room for the 4 s the proxy holds each answer.
	s := startStack(t, 0, []string{"IDEMQ_FAKEPAY_HONOR_KEYS=true"}, []string{"IDEMQ_LEASE=8s"})
	proxy := holdAnswers(t, s.fakepayURL, 4*time.Second)
	s.workerEnv = append(s.workerEnv, "IDEMQ_FAKEPAY_URL="+proxy) // the later value wins
	s.startWorker(t, 0)

	ctx := testenv.Context(t, 2*time.Minute)
	charge := tasks.Charge{OrderID: "killed-1", CustomerID: "c-k", AmountCents: 4200, Currency: "EUR"}
	task, _ := tasks.NewChargeTask(charge)
	s.enqueue(t, task)

	// Kill the worker once the provider has made the charge, before the worker hears of it.
	for {
		var n int
		s.pool.QueryRow(ctx, `SELECT count(*) FROM fakepay_charges WHERE order_id = $1`, charge.OrderID).Scan(&n)
		if n > 0 {
			break
		}
		if ctx.Err() != nil {
			t.Fatal("the provider never made the charge")
		}
		time.Sleep(20 * time.Millisecond)
	}
	s.workers[0].signal(syscall.SIGKILL)
	<-s.workers[0].done
	var status string
	s.pool.QueryRow(ctx, `SELECT status FROM processed_jobs WHERE idempotency_key = $1`, charge.Key()).Scan(&status)
	if status != "in_progress" {
		t.Fatalf("after the kill the key is %q, want in_progress (killed between effect and completion)", status)
	}

	// asynq would redeliver only after its own recovery (60–120 s); a duplicate delivery
	// under another TaskID forces the takeover once our 8 s lease has run out.
	s.startWorker(t, 0)
	dup, _ := tasks.NewChargeTask(charge)
	s.enqueue(t, dup, asynq.TaskID(charge.Key()+"#dup"))
	s.waitCompleted(t, 1, 60*time.Second)

	var charges, attempts, requests int
	var chargeID, resultID string
	s.pool.QueryRow(ctx, `SELECT count(*), min(id) FROM fakepay_charges WHERE order_id = $1`, charge.OrderID).Scan(&charges, &chargeID)
	s.pool.QueryRow(ctx, `SELECT result->>'charge_id', attempts FROM processed_jobs WHERE idempotency_key = $1`, charge.Key()).Scan(&resultID, &attempts)
	s.pool.QueryRow(ctx, `SELECT count(*) FROM fakepay_requests WHERE idempotency_key = $1`, charge.Key()).Scan(&requests)
	if charges != 1 || resultID != chargeID || attempts < 2 || requests < 2 {
		t.Fatalf("charges %d, ledger result names %q, provider made %q, attempts %d, provider requests %d; want one charge named by the result after a takeover that called the provider again", charges, resultID, chargeID, attempts, requests)
	}
	t.Logf("killed mid-charge: %d provider requests with the key, %d charge (%s), ledger attempts %d", requests, charges, chargeID, attempts)
}

// TestEndToEndNegativeControl runs duplicate deliveries with the guards switched off: the
// checks of TestEndToEndDuplicatesTakeEffectOnce must then find duplicates, or they prove
// nothing.
func TestEndToEndNegativeControl(t *testing.T) {
	t.Parallel()
	const jobs, copies = 50, 3
	s := startStack(t, 2, []string{"IDEMQ_FAKEPAY_HONOR_KEYS=false"}, []string{"IDEMQ_UNSAFE_NO_GUARDS=true"})
	for i := range jobs {
		for c := range copies {
			charge, _ := tasks.NewChargeTask(tasks.Charge{OrderID: fmt.Sprintf("o-%d", i), CustomerID: "c", AmountCents: 1, Currency: "EUR"})
			s.enqueue(t, charge, asynq.TaskID(fmt.Sprintf("c%d-%d", c, i)))
			debit, _ := tasks.NewDebitTask(tasks.Debit{AccountID: "a", AmountCents: 1, Reference: fmt.Sprintf("r-%d", i)})
			s.enqueue(t, debit, asynq.TaskID(fmt.Sprintf("d%d-%d", c, i)))
		}
	}
	ctx := testenv.Context(t, time.Minute)
	for {
		q, err := s.insp.GetQueueInfo(tasks.Queue)
		if err != nil {
			t.Fatal(err)
		}
		if q.Pending+q.Active+q.Retry+q.Scheduled == 0 {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("queue did not drain: %+v", q)
		}
		time.Sleep(100 * time.Millisecond)
	}
	var charges, entries int
	s.pool.QueryRow(ctx, `SELECT count(*) FROM fakepay_charges`).Scan(&charges)
	s.pool.QueryRow(ctx, `SELECT count(*) FROM wallet_entries`).Scan(&entries)
	t.Logf("guards off: %d jobs × %d deliveries made %d charges and %d wallet entries", jobs, copies, charges, entries)
	if charges != jobs*copies || entries != jobs*copies {
		t.Fatalf("with the guards off every delivery should take effect: charges %d, entries %d, want %d each", charges, entries, jobs*copies)
	}
}

func TestDemo(t *testing.T) {
	t.Parallel()
	env := []string{"DATABASE_URL=" + firstNonEmpty(os.Getenv("TEST_DATABASE_URL"), os.Getenv("DATABASE_URL")),
		"REDIS_URL=" + firstNonEmpty(os.Getenv("TEST_REDIS_URL"), os.Getenv("REDIS_URL"))}
	for i := len(env) - 1; i >= 0; i-- {
		if strings.HasSuffix(env[i], "=") {
			env = append(env[:i], env[i+1:]...)
		}
	}
	takeStackSlot(t)
	out, stderr, err := idemq(t, env, "demo", "--charges", "25", "--debits", "25", "--checkouts", "25")
	if err != nil {
		t.Fatalf("idemq demo: %v\n%s\n%s", err, out, stderr)
	}
	for _, want := range []string{"most charges for one order            1", "most entries for one reference            1",
		"most charges for one checkout            1", "most order rows for one checkout            1",
		"jobs never finished            0", "orders charged once each", "25 checkouts charged, recorded and emailed once each",
		"The guards prevented"} {
		if !strings.Contains(out, want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
	// With guards, one receipt per checkout, and any more are the re-sent ones the table
	// and the verdict attribute to a delivery that stopped before its record.
	emails := regexp.MustCompile(`receipt emails / checkouts\s+(\d+) / (\d+)`).FindStringSubmatch(out)
	resent := regexp.MustCompile(`re-sent \(the sender stopped before its record\)\s+(\d+)`).FindStringSubmatch(out)
	if emails == nil || resent == nil || emails[2] != "25" || atoi(t, emails[1]) != 25+atoi(t, resent[1]) {
		t.Errorf("with guards, receipt emails %q and re-sent %q: want 25 checkouts emailed, 25 emails plus the re-sent ones:\n%s", emails, resent, out)
	}
	if resent != nil {
		if n := atoi(t, resent[1]); n > 0 != strings.Contains(out, fmt.Sprintf("But %d receipts were emailed again", n)) {
			t.Errorf("the verdict does not account for the %d re-sent receipts:\n%s", n, out)
		}
	}
	// What the log says happened, the table and the last line say too.
	// The table's first column and the last line speak of the guarded run, whose log ends
	// where the unguarded run's begins.
	guardedLog, _, _ := strings.Cut(out, "The same workload with the lock and the ledger switched off")
	killed := strings.Contains(guardedLog, "SIGKILLed worker 1 (pid")
	if row := regexp.MustCompile(`worker SIGKILLed mid-flight\s+(\w+)`).FindStringSubmatch(out); row == nil || row[1] != fmt.Sprint(killed) {
		t.Errorf("the table's kill row %q disagrees with the log (killed: %t):\n%s", row, killed, out)
	}
	schedKilled := strings.Contains(guardedLog, "SIGKILLed scheduler 1 (pid")
	if killed != (strings.Contains(out, "and a SIGKILLed worker.") || strings.Contains(out, "a SIGKILLed worker and a SIGKILLed scheduler.")) ||
		schedKilled != strings.Contains(out, "and a SIGKILLed scheduler.") {
		t.Errorf("the last line disagrees with the log on the kills (worker: %t, scheduler: %t):\n%s", killed, schedKilled, out)
	}
	// The example's schedule runs in two scheduler replicas, one SIGKILLed on the way:
	// with guards, every 2 s tick from the first to the last is one settlement.
	ticks := regexp.MustCompile(`periodic ticks \(2s, 2 schedulers\) / expected\s+(\d+) / (\d+)`).FindStringSubmatch(out)
	settled := regexp.MustCompile(`settlements / ticks settled\s+(\d+) / (\d+)`).FindStringSubmatch(out)
	if !schedKilled || ticks == nil || settled == nil || atoi(t, ticks[2]) < 6 || ticks[1] != ticks[2] || settled[1] != ticks[2] || settled[2] != ticks[2] ||
		!strings.Contains(out, "most settlements for one tick            1") ||
		!strings.Contains(out, fmt.Sprintf("and %s ticks settled once each", ticks[2])) {
		t.Errorf("with guards, ticks %q and settlements %q (scheduler killed: %t): want at least 6 ticks, each enqueued and settled once:\n%s", ticks, settled, schedKilled, out)
	}
	// Nothing is left behind: the log folders of both runs are gone.
	for _, m := range regexp.MustCompile(`logs in (\S+)\)`).FindAllStringSubmatch(out, -1) {
		if _, err := os.Stat(m[1]); !os.IsNotExist(err) {
			t.Errorf("the demo left its log folder %s (stat: %v)", m[1], err)
		}
	}
	t.Logf("idemq demo:\n%s", out)
}

func atoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestWorkerDrainsOnSIGTERM(t *testing.T) {
	t.Parallel()
	// Each charge takes up to 2 s at the provider; SIGTERM arrives while they run. A
	// charge's call must end before its lease's self-fence deadline, less the margin
	// (about 0.8 of the lease): a 5 s lease gives it 4 s.
	s := startStack(t, 1, []string{"IDEMQ_FAKEPAY_DELAY=2s"}, []string{"IDEMQ_LEASE=5s"})
	ctx := testenv.Context(t, time.Minute)
	for i := range 5 {
		task, _ := tasks.NewChargeTask(tasks.Charge{OrderID: fmt.Sprintf("drain-%d", i), CustomerID: fmt.Sprintf("c-%d", i), AmountCents: 1, Currency: "EUR"})
		s.enqueue(t, task)
	}
	for n := 0; n < 5; time.Sleep(20 * time.Millisecond) {
		s.pool.QueryRow(ctx, `SELECT count(*) FROM processed_jobs WHERE status = 'in_progress'`).Scan(&n)
		if ctx.Err() != nil {
			t.Fatalf("only %d of 5 charges started", n)
		}
	}
	start := time.Now()
	s.workers[0].signal(syscall.SIGTERM)
	select {
	case <-s.workers[0].done:
	case <-time.After(15 * time.Second):
		t.Fatal("the worker did not exit within 15 s of SIGTERM (IDEMQ_SHUTDOWN_TIMEOUT=5s)")
	}
	if code := s.workers[0].cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("worker exited %d after SIGTERM, want 0", code)
	}
	var completed int
	s.pool.QueryRow(ctx, `SELECT count(*) FROM processed_jobs WHERE status = 'completed'`).Scan(&completed)
	if completed != 5 {
		t.Fatalf("%d of 5 charges completed by the drain, want all (they were running when SIGTERM came)", completed)
	}
	t.Logf("SIGTERM with 5 charges running: the worker finished them and exited 0 in %s", time.Since(start).Round(10*time.Millisecond))
}
