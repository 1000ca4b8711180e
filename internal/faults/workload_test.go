//go:build faults

package faults

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"net/http"
	"sync"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/tasks"
)

// createExpected is the suite's own record of every job it means to run, written before
// the job is sent: the checker's list of what must exist exactly once.
const createExpected = `CREATE TABLE faults_expected (
	key         text PRIMARY KEY,
	kind        text NOT NULL,     -- charge | debit | checkout
	ref         text NOT NULL,     -- order_id (of a charge or a checkout) or reference
	dup         boolean NOT NULL,  -- also sent a second time straight to asynq
	recorded_at timestamptz NOT NULL DEFAULT now()
)`

// job is one planned job of the workload.
type job struct {
	at       time.Duration // when to send it, from the start of the workload
	charge   *tasks.Charge
	debit    *tasks.Debit
	checkout *tasks.Checkout
	dup      bool
	dupAfter time.Duration // when the duplicate follows the API request
}

func (j job) key() string {
	switch {
	case j.checkout != nil:
		return j.checkout.Key()
	case j.charge != nil:
		return j.charge.Key()
	}
	return j.debit.Key()
}

func (j job) spec() outbox.Spec {
	var s outbox.Spec
	var err error
	switch {
	case j.checkout != nil:
		s, err = tasks.CheckoutSpec(*j.checkout)
	case j.charge != nil:
		s, err = tasks.ChargeSpec(*j.charge)
	default:
		s, err = tasks.DebitSpec(*j.debit)
	}
	if err != nil {
		panic(err) // the plan builds valid jobs
	}
	return s
}

// plan derives n jobs from seed: one in checkoutEvery a checkout, the others half
// charges, half debits; about 20% with a duplicate, sent evenly over spread.
// Of every burstEvery jobs, the first burstSize are sent at once.
const burstEvery, burstSize = 40, 24

// checkoutEvery places the checkouts: job i is one when i%checkoutEvery == checkoutAt
// (12.5% of the jobs: 5 of every 40, 3 of them in its burst). A checkout takes the place of the
// charge or debit the seed drew there, and its fields come from a stream of their own, so
// the seed's other jobs are those it made before checkouts existed.
const checkoutEvery, checkoutAt = 8, 3

func plan(seed uint64, n int, spread time.Duration) []job {
	rng := rand.New(rand.NewPCG(seed, 1))
	crng := rand.New(rand.NewPCG(seed, 3))
	jobs := make([]job, n)
	for i := range jobs {
		// Most of every 40 jobs arrive together at its start, the rest spread after them:
		// a burst is what makes a worker's deliveries meet (shared transactions, a scope's
		// riders) while the nemesis runs.
		at := i
		if i%burstEvery < burstSize {
			at = i - i%burstEvery
		}
		j := job{at: spread * time.Duration(at) / time.Duration(n)}
		if rng.IntN(2) == 0 {
			j.charge = &tasks.Charge{OrderID: fmt.Sprintf("o-%d", i), CustomerID: fmt.Sprintf("c-%d", rng.IntN(n/2+1)),
				AmountCents: int64(100 + rng.IntN(10000)), Currency: "EUR"}
		} else {
			j.debit = &tasks.Debit{AccountID: fmt.Sprintf("a-%d", rng.IntN(n/2+1)), AmountCents: int64(1 + rng.IntN(500)),
				Reference: fmt.Sprintf("r-%d", i)}
		}
		if rng.Float64() < 0.2 {
			j.dup, j.dupAfter = true, time.Duration(rng.IntN(3000))*time.Millisecond
		}
		if i%checkoutEvery == checkoutAt {
			// Customers from the charges' range: a checkout and a charge of one customer
			// share a lock scope.
			j.checkout = &tasks.Checkout{OrderID: fmt.Sprintf("co-%d", i), CustomerID: fmt.Sprintf("c-%d", crng.IntN(n/2+1)),
				AmountCents: int64(100 + crng.IntN(10000)), Currency: "EUR", Email: fmt.Sprintf("buyer-%d@example.com", i)}
			j.charge, j.debit = nil, nil
		}
		jobs[i] = j
	}
	return jobs
}

// drive sends the jobs on their schedule: record the key, POST it to the API (retrying
// through outages), then send the duplicate straight to asynq under TaskID key#dup. It
// returns when every job was accepted and every duplicate sent or given up.
func (c *cluster) drive(ctx context.Context, jobs []job) error {
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, len(jobs))
	sem := make(chan struct{}, 16)
	for _, j := range jobs {
		if d := j.at - time.Since(start); d > 0 {
			select {
			case <-time.After(d):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if err := c.send(ctx, j); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	return errors.Join(collect(errs)...)
}

func collect(ch chan error) []error {
	var out []error
	for e := range ch {
		out = append(out, e)
	}
	return out
}

func (c *cluster) send(ctx context.Context, j job) error {
	key, kind, ref := j.key(), "debit", ""
	switch {
	case j.checkout != nil:
		kind, ref = "checkout", j.checkout.OrderID
	case j.charge != nil:
		kind, ref = "charge", j.charge.OrderID
	default:
		ref = j.debit.Reference
	}
	if err := retry(ctx, time.Minute, func() error {
		_, err := c.pool.Exec(ctx, `INSERT INTO faults_expected (key, kind, ref, dup) VALUES ($1, $2, $3, $4)
			ON CONFLICT (key) DO NOTHING`, key, kind, ref, j.dup)
		return err
	}); err != nil {
		return fmt.Errorf("record %s: %w", key, err)
	}
	path, body := "/v1/wallet/debits", any(j.debit)
	switch {
	case j.checkout != nil:
		path, body = "/v1/checkouts", j.checkout
	case j.charge != nil:
		path, body = "/v1/charges", j.charge
	}
	b, _ := json.Marshal(body)
	if err := retry(ctx, 90*time.Second, func() error {
		apis := *c.apis.Load()
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, apis[int(crc32.ChecksumIEEE([]byte(key)))%len(apis)]+path, bytes.NewReader(b))
		req.Header.Set("Content-Type", "application/json")
		resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusAccepted, http.StatusOK:
			return nil
		case http.StatusBadRequest, http.StatusUnprocessableEntity:
			return backoffStop{fmt.Errorf("POST %s %s: %d", path, b, resp.StatusCode)}
		}
		return fmt.Errorf("POST %s: %d", path, resp.StatusCode)
	}); err != nil {
		return fmt.Errorf("send %s: %w", key, err)
	}
	if !j.dup {
		return nil
	}
	time.Sleep(j.dupAfter)
	if err := c.enqueueDup(ctx, j.spec(), j.spec().Key+"#dup"); err != nil {
		c.hist.add(func(h *history) { h.dupErrors++ })
		return nil // Redis down the whole time: a lost duplicate is no loss
	}
	c.hist.add(func(h *history) { h.dups++ })
	return nil
}

// enqueueDup publishes a second delivery of a job straight to asynq under taskID (test
// only: the API dedups).
func (c *cluster) enqueueDup(ctx context.Context, s outbox.Spec, taskID string) error {
	return retry(ctx, 20*time.Second, func() error {
		_, err := c.client.EnqueueContext(ctx, s.Task(taskID, time.Now()))
		if errors.Is(err, asynq.ErrTaskIDConflict) {
			return nil
		}
		return err
	})
}

// specFor rebuilds a job's Spec from its recorded key and the stored intent.
func (c *cluster) specFor(ctx context.Context, key string) (outbox.Spec, error) {
	var s outbox.Spec
	var timeoutMS, retentionMS int64
	err := c.pool.QueryRow(ctx, `SELECT idempotency_key, task_type, payload, queue, max_retry, timeout_ms, retention_ms
		FROM job_intents WHERE idempotency_key = $1`, key).Scan(&s.Key, &s.Type, &s.Payload, &s.Queue, &s.MaxRetry, &timeoutMS, &retentionMS)
	s.Timeout, s.Retention = time.Duration(timeoutMS)*time.Millisecond, time.Duration(retentionMS)*time.Millisecond
	return s, err
}

// badPayloads are deliberate bad inputs: each must be archived with a reason, no retry and
// no ledger row.
var badPayloads = map[string]*asynq.Task{
	"bad-malformed":     asynq.NewTask(tasks.TypeCharge, []byte(`{"order_id":`)),
	"bad-missing-field": asynq.NewTask(tasks.TypeDebit, []byte(`{"account_id":"a"}`)),
	"bad-negative":      asynq.NewTask(tasks.TypeCharge, []byte(`{"order_id":"o","customer_id":"c","amount_cents":-1,"currency":"EUR"}`)),
}

func (c *cluster) enqueueBad(ctx context.Context) error {
	// A fresh client: asynq's client adds a queue to asynq:queues only on its first
	// enqueue, so the suite's long-lived client would not register the queue again after
	// Redis lost everything (the relay and reconciler do since a1a0150).
	client := asynq.NewClientFromRedisClient(c.rdb)
	c.badEnqueued = time.Now()
	for id, task := range badPayloads {
		if err := retry(ctx, 20*time.Second, func() error {
			_, err := client.EnqueueContext(ctx, task, asynq.TaskID(id), asynq.MaxRetry(3))
			if errors.Is(err, asynq.ErrTaskIDConflict) {
				return nil
			}
			return err
		}); err != nil {
			return fmt.Errorf("enqueue %s: %w", id, err)
		}
	}
	return nil
}

// backoffStop ends a retry at once.
type backoffStop struct{ error }

// retry calls f until it succeeds, returns backoffStop, or d has passed.
func retry(ctx context.Context, d time.Duration, f func() error) error {
	deadline := time.Now().Add(d)
	wait := 100 * time.Millisecond
	for {
		err := f()
		var stop backoffStop
		if err == nil {
			return nil
		}
		if errors.As(err, &stop) {
			return stop.error
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return err
		}
		select {
		case <-time.After(wait):
		case <-ctx.Done():
		}
		wait = min(2*wait, 2*time.Second)
	}
}
