package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
)

// Task type names.
const (
	TypeCharge = "payment:charge"
	TypeDebit  = "wallet:debit"
)

// MaxAmountCents is the largest amount_cents a charge or a debit may carry:
// 99,999,999,999 cents (999,999,999.99 in the currency). It is far below 2^53, so every
// JSON client reads it exactly, and a sum of many such amounts stays within int64. A
// larger amount is refused by Validate, by the API (422) and, for a task already queued,
// by DecodeCharge and DecodeDebit (the task is archived with the reason).
const MaxAmountCents = 99_999_999_999

// Queue is the asynq queue both example task types go to.
const Queue = "default"

// Default asynq options of the example task types.
const (
	DefaultMaxRetry  = 10
	DefaultRetention = 24 * time.Hour
	chargeTimeout    = 2 * time.Minute
	debitTimeout     = 30 * time.Second
)

// The payloads are jobs of the library's middleware.
var (
	_ idempotency.Job = Charge{}
	_ idempotency.Job = Debit{}
)

// Charge is the payload of payment:charge: charge a customer for an order, once.
type Charge struct {
	OrderID     string `json:"order_id"`
	CustomerID  string `json:"customer_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
}

// Key returns "charge:<order_id>".
func (c Charge) Key() string { return "charge:" + c.OrderID }

// LockScope returns "customer:<customer_id>", so two charges of one customer never run at
// the same moment.
func (c Charge) LockScope() string { return "customer:" + c.CustomerID }

// Validate reports the first invalid field, by its JSON name.
func (c Charge) Validate() error {
	if err := checkID("order_id", c.OrderID, "charge:"); err != nil {
		return err
	}
	if err := checkID("customer_id", c.CustomerID, "customer:"); err != nil {
		return err
	}
	if err := checkAmount(c.AmountCents); err != nil {
		return err
	}
	if len(c.Currency) != 3 || !isLetters(c.Currency) {
		return fmt.Errorf("currency: must be a three-letter ISO 4217 code (in any case: usd is USD), got %q", c.Currency)
	}
	return nil
}

// fields are c's fields for decodePlain, by their JSON names.
func (c *Charge) fields() []field {
	return []field{{name: "order_id", str: &c.OrderID}, {name: "customer_id", str: &c.CustomerID},
		{name: "amount_cents", num: &c.AmountCents}, {name: "currency", str: &c.Currency}}
}

// Canonical returns c with its enumerated fields in canonical form: Currency in upper
// case, as ISO 4217 writes it (only ASCII letters change). "usd" and "USD" are one
// payload, so one fingerprint and one job; ChargeSpec, NewChargeTask and DecodeCharge
// call it. The identifiers are kept as sent: they are case-sensitive.
func (c Charge) Canonical() Charge {
	c.Currency = upperASCII(c.Currency)
	return c
}

// Debit is the payload of wallet:debit: take an amount from an account, once per
// reference.
type Debit struct {
	AccountID   string `json:"account_id"`
	AmountCents int64  `json:"amount_cents"`
	Reference   string `json:"reference"`
}

// Key returns "debit:<reference>".
func (d Debit) Key() string { return "debit:" + d.Reference }

// LockScope returns "account:<account_id>".
func (d Debit) LockScope() string { return "account:" + d.AccountID }

// Validate reports the first invalid field, by its JSON name.
func (d Debit) Validate() error {
	if err := checkID("account_id", d.AccountID, "account:"); err != nil {
		return err
	}
	if err := checkAmount(d.AmountCents); err != nil {
		return err
	}
	return checkID("reference", d.Reference, "debit:")
}

// fields are d's fields for decodePlain, by their JSON names.
func (d *Debit) fields() []field {
	return []field{{name: "account_id", str: &d.AccountID}, {name: "amount_cents", num: &d.AmountCents},
		{name: "reference", str: &d.Reference}}
}

// DecodeCharge strictly decodes and validates a payment:charge payload and returns it in
// canonical form (Charge.Canonical): unknown, duplicate and case-variant fields (see
// idempotency.CheckFieldNames), trailing data, a payload over idempotency.MaxPayloadBytes
// and invalid fields are errors that name the problem (idempotency.DecodeStrict).
func DecodeCharge(payload []byte) (Charge, error) {
	var c Charge
	if !decodePlain(payload, c.fields()) {
		var err error
		if c, err = decodeStrict[Charge](payload); err != nil {
			return Charge{}, err
		}
	}
	c = c.Canonical()
	return c, c.Validate()
}

// DecodeDebit strictly decodes and validates a wallet:debit payload, like DecodeCharge.
func DecodeDebit(payload []byte) (Debit, error) {
	var d Debit
	if !decodePlain(payload, d.fields()) {
		var err error
		if d, err = decodeStrict[Debit](payload); err != nil {
			return Debit{}, err
		}
	}
	return d, d.Validate()
}

// ChargeSpec validates c and returns its Spec, with c's payload in canonical form
// (Charge.Canonical): key c.Key(), queue Queue, the default retry and retention, a
// 2-minute timeout.
func ChargeSpec(c Charge) (outbox.Spec, error) {
	c = c.Canonical()
	if err := c.Validate(); err != nil {
		return outbox.Spec{}, fmt.Errorf("%s: %w", TypeCharge, err)
	}
	return newSpec(TypeCharge, c, c.Key(), chargeTimeout)
}

// DebitSpec validates d and returns its Spec, like ChargeSpec, with a 30-second timeout.
func DebitSpec(d Debit) (outbox.Spec, error) {
	if err := d.Validate(); err != nil {
		return outbox.Spec{}, fmt.Errorf("%s: %w", TypeDebit, err)
	}
	return newSpec(TypeDebit, d, d.Key(), debitTimeout)
}

func newSpec(typ string, payload any, key string, timeout time.Duration) (outbox.Spec, error) {
	b, err := json.Marshal(payload)
	if err != nil {
		return outbox.Spec{}, fmt.Errorf("%s: encode payload: %w", typ, err)
	}
	return outbox.Spec{Key: key, Type: typ, Payload: b, Queue: Queue, MaxRetry: DefaultMaxRetry,
		Timeout: timeout, Retention: DefaultRetention}, nil
}

// NewChargeTask validates c and returns its task for a direct publish: TaskID c.Key() and
// ChargeSpec's options, which opts may override.
func NewChargeTask(c Charge, opts ...asynq.Option) (*asynq.Task, error) {
	s, err := ChargeSpec(c)
	if err != nil {
		return nil, err
	}
	return s.Task(s.Key, time.Now(), opts...), nil
}

// NewDebitTask validates d and returns its task, like NewChargeTask.
func NewDebitTask(d Debit, opts ...asynq.Option) (*asynq.Task, error) {
	s, err := DebitSpec(d)
	if err != nil {
		return nil, err
	}
	return s.Task(s.Key, time.Now(), opts...), nil
}

// Enqueuer is the part of *asynq.Client that Enqueue needs.
type Enqueuer interface {
	EnqueueContext(ctx context.Context, task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error)
}

var _ Enqueuer = (*asynq.Client)(nil)

// Enqueue enqueues task. A task whose TaskID is already taken is not an error: it returns
// duplicate true and a nil info, since the job is already enqueued (or done and retained).
// Other errors come back from asynq unchanged.
func Enqueue(ctx context.Context, c Enqueuer, task *asynq.Task, opts ...asynq.Option) (info *asynq.TaskInfo, duplicate bool, err error) {
	info, err = c.EnqueueContext(ctx, task, opts...)
	if errors.Is(err, asynq.ErrTaskIDConflict) {
		return nil, true, nil
	}
	if err != nil {
		return nil, false, err
	}
	return info, false, nil
}

// decodeStrict decodes payload with idempotency.DecodeStrict, which explains every
// refusal; an amount_cents too large to decode is refused as Validate refuses an amount
// over MaxAmountCents. DecodeCharge and DecodeDebit call it for a payload decodePlain does
// not take.
func decodeStrict[T any](payload []byte) (T, error) {
	v, err := idempotency.DecodeStrict[T](payload)
	var typeErr *json.UnmarshalTypeError
	if errors.As(err, &typeErr) && typeErr.Field != "" {
		if amount, ok := TypeError(typeErr).(amountError); ok {
			return v, amount
		}
	}
	return v, err
}

// checkAmount reports an amount_cents outside 1..MaxAmountCents.
func checkAmount(v int64) error {
	if v <= 0 || v > MaxAmountCents {
		return amountError(strconv.FormatInt(v, 10))
	}
	return nil
}

// amountError is an amount_cents outside 1..MaxAmountCents, as sent.
type amountError string

func (got amountError) Error() string {
	return fmt.Sprintf("amount_cents: must be a positive whole number of cents, at most %d, got %s", MaxAmountCents, string(got))
}

// TypeError describes e, a JSON value of the wrong type (or out of range) for a field of
// a payload, naming the field: "amount_cents: must be a JSON whole number, got string".
// An amount_cents that is a number too large to decode is refused as Validate refuses an
// amount over MaxAmountCents. The value is quoted as sent, cut to 24 bytes with its
// length, so that an error never echoes a huge number back.
func TypeError(e *json.UnmarshalTypeError) error {
	got := e.Value
	if num, ok := strings.CutPrefix(got, "number "); ok {
		got = "number " + cutValue(num)
		if e.Field == "amount_cents" && isDigits(strings.TrimPrefix(num, "-")) {
			return amountError(cutValue(num))
		}
	}
	want := e.Type.Kind().String()
	switch e.Type.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		want = "whole number"
	case reflect.Float32, reflect.Float64:
		want = "number"
	}
	return fmt.Errorf("%s: must be a JSON %s, got %s", e.Field, want, got)
}

// cutValue is v cut to 24 bytes, followed by its length when it was longer.
func cutValue(v string) string {
	if len(v) <= 24 {
		return v
	}
	return fmt.Sprintf("%s… (%d characters)", v[:24], len(v))
}

func isDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return s != ""
}

// checkID checks an identifier that becomes part of a key (or scope) after prefix, by the
// library's key rules: within idempotency.MaxKeyBytes with the prefix, and no byte
// idempotency.KeyByteProblem refuses.
func checkID(field, v, prefix string) error {
	if v == "" {
		return fmt.Errorf("%s: required", field)
	}
	if max := idempotency.MaxKeyBytes - len(prefix); len(v) > max {
		return fmt.Errorf("%s: %d bytes; the limit is %d (keys are at most %d bytes)", field, len(v), max, idempotency.MaxKeyBytes)
	}
	for i := 0; i < len(v); i++ {
		if problem := idempotency.KeyByteProblem(v[i]); problem != "" {
			return fmt.Errorf("%s: byte %d is %q: %s", field, i, v[i], problem)
		}
	}
	return nil
}

// isLetters reports whether s is ASCII letters only, in either case.
func isLetters(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i] | 0x20; c < 'a' || c > 'z' {
			return false
		}
	}
	return true
}

// upperASCII returns s with ASCII a-z in upper case and every other byte as it is (unlike
// strings.ToUpper, which makes "uſd" "USD").
func upperASCII(s string) string {
	for i := 0; i < len(s); i++ {
		if 'a' <= s[i] && s[i] <= 'z' {
			b := []byte(s)
			for j := i; j < len(b); j++ {
				if 'a' <= b[j] && b[j] <= 'z' {
					b[j] -= 'a' - 'A'
				}
			}
			return string(b)
		}
	}
	return s
}
