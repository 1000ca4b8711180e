package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/dial"
	"github.com/idemq/idemq/tasks"
)

// apiRequestTimeout bounds one call of the load generator.
const apiRequestTimeout = 30 * time.Second

// apiLoadResult is what the load generator reports, as one line of JSON on stdout.
type apiLoadResult struct {
	Requests   int     `json:"requests"` // calls finished, failed ones included
	Errors     int     `json:"errors"`
	FirstError string  `json:"first_error,omitempty"`
	P50ms      float64 `json:"p50_ms"` // of the successful calls
	P99ms      float64 `json:"p99_ms"`
	MaxMS      float64 `json:"max_ms"`
	Seconds    float64 `json:"elapsed_s"` // from the first call's start to the last one's end
	// Sends are the e2e path's accepted debits: each one's key and when its request was
	// sent.
	Sends []apiSend `json:"sends,omitempty"`
	// Codes counts the sustained path's answers by HTTP status ("none" for a call that
	// got no answer).
	Codes map[string]int `json:"codes,omitempty"`
}

type apiSend struct {
	Key    string `json:"key"`
	SentNS int64  `json:"sent_unix_ns"`
}

// loadOp is one call of a path: i numbers it within the run; it returns the job's key.
type loadOp func(ctx context.Context, i int) (key string, err error)

const insertFloorSQL = `INSERT INTO bench_floor (key, payload) VALUES ($1, $2)`

// runAPIChild is API mode's load generator (idemq-bench -api-child), in a process of its own:
// one path's load (APIPathNames, or apiPathSustain) on REDIS_URL and DATABASE_URL or on
// the api at -url, reported as one line of JSON (apiLoadResult) on stdout. The throughput
// paths keep -c calls in flight for -seconds; the e2e and sustained paths send -rate
// debits per second for -seconds without waiting for the answers.
//
// With -wait it sets up first (connections open, the relay running), writes "ready" and
// starts on a line on its stdin; after the result it keeps everything open, its relay
// running, until its stdin closes, so that the parent reads CPU times and the outbox's
// state with the load's connections still there.
func runAPIChild(ctx context.Context, redisURL, databaseURL string, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("idemq-bench "+apiChildFlag, flag.ContinueOnError)
	fs.SetOutput(stderr)
	path := fs.String("path", APIPathAPI, "the path: api, asynq, insert, enqueue, enqueuetx, e2e or sustain")
	conc := fs.Int("c", 50, "calls in flight (throughput paths)")
	seconds := fs.Float64("seconds", 10, "how long the load runs")
	baseURL := fs.String("url", "", "the api's base URL (api, e2e and sustain paths)")
	rate := fs.Float64("rate", 20, "e2e and sustain: debits sent per second")
	prefix := fs.String("prefix", "", "start of every order id and reference (default: random)")
	wait := fs.Bool("wait", false, `set up, write "ready", start on a line on stdin, and after the result keep everything open until stdin closes`)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *conc < 1 || *seconds <= 0 || *rate <= 0 {
		return fmt.Errorf("bench: %s: -c, -seconds and -rate must be positive", apiChildFlag)
	}
	if *prefix == "" {
		*prefix = randomHex(4)
	}

	var op loadOp
	var sustain *sustainLoad
	switch *path {
	case APIPathAPI, APIPathE2E, apiPathSustain:
		if *baseURL == "" {
			return fmt.Errorf("bench: %s -path %s: -url is required", apiChildFlag, *path)
		}
		idle := *conc
		if *path == apiPathSustain {
			// An open loop has as many calls in flight as the api's latency makes it:
			// keep their connections for the next calls.
			idle = 1024
		}
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxIdleConns, tr.MaxIdleConnsPerHost = max(idle, 100), idle
		client := &http.Client{Transport: bearerTransport{tr, os.Getenv("IDEMQ_API_TOKEN")}}
		defer client.CloseIdleConnections()
		switch *path {
		case apiPathSustain:
			sustain = newSustainLoad(client, *baseURL, *prefix)
			op = sustain.op
		case APIPathAPI:
			op = func(ctx context.Context, i int) (string, error) {
				c := benchCharge(*prefix, i)
				return c.Key(), postJob(ctx, client, *baseURL+"/v1/charges", c, randomHex(16))
			}
		default:
			op = func(ctx context.Context, i int) (string, error) {
				d := tasks.Debit{AccountID: "acct-" + strconv.Itoa(rand.IntN(13)), AmountCents: 100 + rand.Int64N(9901), Reference: *prefix + "-" + strconv.Itoa(i)}
				return d.Key(), postJob(ctx, client, *baseURL+"/v1/wallet/debits", d, "")
			}
		}
	case APIPathAsynq:
		rdb, err := dial.Redis(ctx, redisURL, false)
		if err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		defer rdb.Close()
		client := asynq.NewClientFromRedisClient(rdb)
		op = func(ctx context.Context, i int) (string, error) {
			spec, err := tasks.ChargeSpec(benchCharge(*prefix, i))
			if err != nil {
				return "", err
			}
			_, err = client.EnqueueContext(ctx, spec.Task(spec.Key, time.Now()))
			return spec.Key, err
		}
	case APIPathInsert:
		pool, err := dial.Postgres(ctx, databaseURL, int32(*conc))
		if err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		defer pool.Close()
		if err := warmPool(ctx, pool); err != nil {
			return err
		}
		op = func(ctx context.Context, i int) (string, error) {
			spec, err := tasks.ChargeSpec(benchCharge(*prefix, i))
			if err != nil {
				return "", err
			}
			_, err = pool.Exec(ctx, insertFloorSQL, spec.Key, string(spec.Payload))
			return spec.Key, err
		}
	case APIPathEnqueue, APIPathEnqueueTx:
		pool, err := dial.Postgres(ctx, databaseURL, int32(*conc+4))
		if err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		defer pool.Close()
		if err := warmPool(ctx, pool); err != nil {
			return err
		}
		rdb, err := dial.Redis(ctx, redisURL, false)
		if err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		defer rdb.Close()
		client := outbox.NewClient(pool, rdb, nil)
		// The relay a user's app or a worker replica runs, for as long as the process.
		relayCtx, stopRelay := context.WithCancel(ctx)
		relayDone := make(chan error, 1)
		go func() { relayDone <- client.RunRelay(relayCtx) }()
		defer func() {
			stopRelay()
			<-relayDone
		}()
		tx := *path == APIPathEnqueueTx
		op = func(ctx context.Context, i int) (string, error) {
			spec, err := tasks.ChargeSpec(benchCharge(*prefix, i))
			if err != nil {
				return "", err
			}
			var res outbox.EnqueueResult
			if tx {
				err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					res, err = client.EnqueueTx(ctx, tx, spec)
					return err
				})
				if err == nil {
					client.Wake(ctx)
				}
			} else {
				res, err = client.Enqueue(ctx, spec)
			}
			if err == nil && res.Duplicate {
				err = fmt.Errorf("%s: recorded before", spec.Key)
			}
			return spec.Key, err
		}
	default:
		return fmt.Errorf("bench: %s: unknown path %q", apiChildFlag, *path)
	}

	in := bufio.NewReader(os.Stdin)
	if *wait {
		if _, err := fmt.Fprintln(stdout, "ready"); err != nil {
			return err
		}
		if _, err := in.ReadString('\n'); err != nil {
			return fmt.Errorf("bench: %s: stdin closed before the start: %w", apiChildFlag, err)
		}
	}
	d := time.Duration(*seconds * float64(time.Second))
	var res apiLoadResult
	switch *path {
	case APIPathE2E:
		res = openLoop(ctx, *rate, d, op, true)
	case apiPathSustain:
		res = openLoop(ctx, *rate, d, op, false)
		res.Codes = sustain.codes()
	default:
		res = closedLoop(ctx, *conc, d, op)
	}
	b, err := json.Marshal(res)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(stdout, "%s\n", b); err != nil {
		return err
	}
	if *wait {
		eof := make(chan struct{})
		go func() {
			io.Copy(io.Discard, in)
			close(eof)
		}()
		select {
		case <-eof:
		case <-ctx.Done():
		}
	}
	return nil
}

// benchCharge is call i's charge: a new order, one of 17 customers, 1 to 100 USD.
func benchCharge(prefix string, i int) tasks.Charge {
	return tasks.Charge{OrderID: prefix + "-" + strconv.Itoa(i), CustomerID: "cust-" + strconv.Itoa(rand.IntN(17)),
		AmountCents: 100 + rand.Int64N(9901), Currency: "USD"}
}

// postJob POSTs body as JSON to url, with an Idempotency-Key header when key is set, and
// wants 202 (a new job) back.
func postJob(ctx context.Context, client *http.Client, url string, body any, key string) error {
	_, err := post(ctx, client, url, body, key, http.StatusAccepted)
	return err
}

// bearerTransport sends token as the bearer token of every request (none when empty).
type bearerTransport struct {
	*http.Transport
	token string
}

func (b bearerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if b.token != "" {
		r = r.Clone(r.Context())
		r.Header.Set("Authorization", "Bearer "+b.token)
	}
	return b.Transport.RoundTrip(r)
}

// post POSTs body as JSON to url, with an Idempotency-Key header when key is set, and
// returns the answer's status code (0 without an answer); an error unless it is want.
func post(ctx context.Context, client *http.Client, url string, body any, key string, want int) (int, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return 0, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(b))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	if err != nil {
		return resp.StatusCode, err
	}
	if resp.StatusCode != want {
		return resp.StatusCode, fmt.Errorf("POST %s: %s (want %d): %s", url, resp.Status, want, bytes.TrimSpace(answer))
	}
	return resp.StatusCode, nil
}

// sustainLoad is the sustained run's calls: each a debit of a new reference on one of 13
// accounts under a new Idempotency-Key, which wants 202; every twentieth instead repeats
// the body of a debit accepted before, under a new Idempotency-Key, which wants 200 (its
// job is a duplicate). Safe for concurrent use.
type sustainLoad struct {
	client *http.Client
	url    string
	prefix string

	mu       sync.Mutex
	accepted []tasks.Debit // the last sustainRecent debits answered 202, a ring
	next     int           // where the ring's next debit goes
	byCode   map[int]int
}

// sustainRecent is how many accepted debits the sustained load keeps to repeat.
const sustainRecent = 4096

func newSustainLoad(client *http.Client, baseURL, prefix string) *sustainLoad {
	return &sustainLoad{client: client, url: baseURL + "/v1/wallet/debits", prefix: prefix, byCode: map[int]int{}}
}

// op is call i.
func (s *sustainLoad) op(ctx context.Context, i int) (string, error) {
	d, want := s.debit(i)
	code, err := post(ctx, s.client, s.url, d, randomHex(16), want)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.byCode[code]++
	if code == http.StatusAccepted {
		if len(s.accepted) < sustainRecent {
			s.accepted = append(s.accepted, d)
		} else {
			s.accepted[s.next] = d
		}
		s.next = (s.next + 1) % sustainRecent
	}
	return d.Key(), err
}

// debit is call i's debit and the status it wants: a repeat of an accepted one (200) for
// every twentieth call once one was accepted, else a new one (202).
func (s *sustainLoad) debit(i int) (tasks.Debit, int) {
	if i%20 == 19 {
		s.mu.Lock()
		n := len(s.accepted)
		var d tasks.Debit
		if n > 0 {
			d = s.accepted[rand.IntN(n)]
		}
		s.mu.Unlock()
		if n > 0 {
			return d, http.StatusOK
		}
	}
	return tasks.Debit{AccountID: "acct-" + strconv.Itoa(rand.IntN(13)), AmountCents: 100 + rand.Int64N(9901),
		Reference: s.prefix + "-" + strconv.Itoa(i)}, http.StatusAccepted
}

// codes returns the answers counted so far by status ("none" for no answer).
func (s *sustainLoad) codes() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int, len(s.byCode))
	for c, n := range s.byCode {
		k := strconv.Itoa(c)
		if c == 0 {
			k = "none"
		}
		out[k] = n
	}
	return out
}

// loadRecord gathers the calls' outcomes.
type loadRecord struct {
	mu       sync.Mutex
	requests int
	errs     int
	firstErr string
	lat      []time.Duration
	sends    []apiSend
}

// add records calls with latencies lat (successful ones), errs failed, the first failure's
// text first.
func (r *loadRecord) add(lat []time.Duration, errs int, first string, sends ...apiSend) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.requests += len(lat) + errs
	r.errs += errs
	if r.firstErr == "" {
		r.firstErr = first
	}
	r.lat = append(r.lat, lat...)
	r.sends = append(r.sends, sends...)
}

func (r *loadRecord) result(elapsed time.Duration) apiLoadResult {
	slices.Sort(r.lat)
	res := apiLoadResult{Requests: r.requests, Errors: r.errs, FirstError: r.firstErr,
		P50ms: millis(percentile(r.lat, 0.50)), P99ms: millis(percentile(r.lat, 0.99)), Seconds: elapsed.Seconds(), Sends: r.sends}
	if len(r.lat) > 0 {
		res.MaxMS = millis(r.lat[len(r.lat)-1])
	}
	return res
}

// call runs op within apiRequestTimeout.
func call(ctx context.Context, op loadOp, i int) (string, time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, apiRequestTimeout)
	defer cancel()
	start := time.Now()
	key, err := op(ctx, i)
	return key, time.Since(start), err
}

// closedLoop calls op from c goroutines, each calling again as soon as its last call
// returned, until d has passed since the start; the calls under way then finish.
func closedLoop(ctx context.Context, c int, d time.Duration, op loadOp) apiLoadResult {
	var rec loadRecord
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(d)
	for range c {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var lat []time.Duration
			var errs int
			var first string
			for time.Now().Before(deadline) && ctx.Err() == nil {
				_, took, err := call(ctx, op, int(next.Add(1))-1)
				if err != nil {
					if errs++; first == "" {
						first = err.Error()
					}
					continue
				}
				lat = append(lat, took)
			}
			rec.add(lat, errs, first)
		}()
	}
	wg.Wait()
	return rec.result(time.Since(start))
}

// openLoop starts call i of op at i/rate seconds after the start, for d, whether the
// earlier ones answered or not (a late wake-up starts the calls it owes at once), and
// waits for them all. With sends it records when each accepted call was sent.
func openLoop(ctx context.Context, rate float64, d time.Duration, op loadOp, sends bool) apiLoadResult {
	var rec loadRecord
	var wg sync.WaitGroup
	n := max(1, int(rate*d.Seconds()+0.5))
	at := func(i int) time.Duration { return time.Duration(float64(i) / rate * float64(time.Second)) }
	timer := time.NewTimer(0)
	defer timer.Stop()
	start := time.Now()
	for i := 0; i < n; {
		due := min(n, int(time.Since(start).Seconds()*rate)+1)
		for ; i < due; i++ {
			sent, k := time.Now(), i
			wg.Add(1)
			go func() {
				defer wg.Done()
				key, took, err := call(ctx, op, k)
				switch {
				case err != nil:
					rec.add(nil, 1, err.Error())
				case sends:
					rec.add([]time.Duration{took}, 0, "", apiSend{Key: key, SentNS: sent.UnixNano()})
				default:
					rec.add([]time.Duration{took}, 0, "")
				}
			}()
		}
		if i == n {
			break
		}
		timer.Reset(time.Until(start.Add(at(i))))
		select {
		case <-timer.C:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
	}
	wg.Wait()
	return rec.result(time.Since(start))
}
