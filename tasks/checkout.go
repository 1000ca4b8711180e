package tasks

import (
	"fmt"
	"strings"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
)

// TypeCheckout is the example's job of several effects: charge the card, record the
// order, email the receipt, each a recorded step of its own.
const TypeCheckout = "order:checkout"

// CheckoutSteps are the steps of a checkout, in the order its handler records them. Each
// step's key, checkout:<order_id>#s/<step>, is what the step hands its provider.
var CheckoutSteps = []string{"charge", "record", "receipt"}

// MaxEmailBytes is the longest email address a checkout takes (RFC 5321's path limit).
const MaxEmailBytes = 254

const checkoutTimeout = 3 * time.Minute

var _ idempotency.Job = Checkout{}

// Checkout is the payload of order:checkout.
type Checkout struct {
	OrderID     string `json:"order_id"`
	CustomerID  string `json:"customer_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
	Email       string `json:"email"`
}

// Key returns "checkout:<order_id>".
func (c Checkout) Key() string { return "checkout:" + c.OrderID }

// LockScope returns "customer:<customer_id>", as a charge's does: a checkout and a charge of
// one customer never run at the same moment.
func (c Checkout) LockScope() string { return "customer:" + c.CustomerID }

// stepRoom is what the longest step key adds to a checkout's key: "#s/" and the longest
// step name.
func stepRoom() int {
	n := 0
	for _, s := range CheckoutSteps {
		n = max(n, len(s))
	}
	return len("#s/") + n
}

// Validate reports the first invalid field, by its JSON name: a charge's fields as
// Charge.Validate checks them, an order id that leaves room in the 255-byte key limit for
// the step keys (checkout:<order_id>#s/receipt), and the email, which is named, never
// quoted: it is personal data.
func (c Checkout) Validate() error {
	if err := c.Charge().Validate(); err != nil {
		return err
	}
	if max := idempotency.MaxKeyBytes - len("checkout:") - stepRoom(); len(c.OrderID) > max {
		return fmt.Errorf("order_id: %d bytes; the limit is %d (a checkout's step keys, checkout:<order_id>#s/<step>, are at most %d bytes)",
			len(c.OrderID), max, idempotency.MaxKeyBytes)
	}
	return checkEmail(c.Email)
}

// Charge is the checkout's charge step: its order, customer and amount.
func (c Checkout) Charge() Charge {
	return Charge{OrderID: c.OrderID, CustomerID: c.CustomerID, AmountCents: c.AmountCents, Currency: c.Currency}
}

// checkEmail refuses what is not a mail address: 1 to MaxEmailBytes bytes of printable
// ASCII without spaces, one '@' with something on each side. It never quotes the address.
func checkEmail(v string) error {
	if v == "" || len(v) > MaxEmailBytes {
		return fmt.Errorf("email: must be 1 to %d bytes, got %d", MaxEmailBytes, len(v))
	}
	at := strings.IndexByte(v, '@')
	if at <= 0 || at == len(v)-1 || strings.Count(v, "@") != 1 {
		return fmt.Errorf("email: must be local@domain")
	}
	for i := 0; i < len(v); i++ {
		if v[i] <= ' ' || v[i] > '~' {
			return fmt.Errorf("email: byte %d is not printable ASCII or is a space", i)
		}
	}
	return nil
}

// fields are c's fields for decodePlain, by their JSON names.
func (c *Checkout) fields() []field {
	return []field{{name: "order_id", str: &c.OrderID}, {name: "customer_id", str: &c.CustomerID},
		{name: "amount_cents", num: &c.AmountCents}, {name: "currency", str: &c.Currency}, {name: "email", str: &c.Email}}
}

// Canonical returns c with Currency in upper case, as Charge.Canonical does.
func (c Checkout) Canonical() Checkout {
	c.Currency = c.Charge().Canonical().Currency
	return c
}

// DecodeCheckout strictly decodes and validates an order:checkout payload, like
// DecodeCharge.
func DecodeCheckout(payload []byte) (Checkout, error) {
	var c Checkout
	if !decodePlain(payload, c.fields()) {
		var err error
		if c, err = decodeStrict[Checkout](payload); err != nil {
			return Checkout{}, err
		}
	}
	c = c.Canonical()
	return c, c.Validate()
}

// CheckoutSpec validates c and returns its Spec, like ChargeSpec, with a 3-minute timeout
// (three steps, two of them calls to the provider).
func CheckoutSpec(c Checkout) (outbox.Spec, error) {
	c = c.Canonical()
	if err := c.Validate(); err != nil {
		return outbox.Spec{}, fmt.Errorf("%s: %w", TypeCheckout, err)
	}
	s, err := newSpec(TypeCheckout, c, c.Key(), checkoutTimeout)
	s.Steps = CheckoutSteps
	return s, err
}

// NewCheckoutTask validates c and returns its task for a direct publish, like
// NewChargeTask.
func NewCheckoutTask(c Checkout, opts ...asynq.Option) (*asynq.Task, error) {
	s, err := CheckoutSpec(c)
	if err != nil {
		return nil, err
	}
	return s.Task(s.Key, time.Now(), opts...), nil
}
