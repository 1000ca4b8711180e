package fakepay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"
	"unicode"
)

// EmailRequest is the body of POST /v1/emails: a receipt to send.
type EmailRequest struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
	OrderID string `json:"order_id"`
}

// Email is a sent email, the body of a successful answer.
type Email struct {
	ID      int64  `json:"id"`
	OrderID string `json:"order_id"`
}

// Limits of an email request's fields, in bytes.
const (
	MaxEmailAddress = 254 // RFC 5321's path limit
	MaxEmailSubject = 200
	MaxEmailOrderID = 255 // an order id within the key limit
)

// validate refuses what no mail provider would send. An address is never quoted back:
// it is personal data.
func (e EmailRequest) validate() error {
	switch {
	case e.To == "" || len(e.To) > MaxEmailAddress:
		return fmt.Errorf("to: must be 1 to %d bytes", MaxEmailAddress)
	case strings.Count(e.To, "@") != 1 || strings.HasPrefix(e.To, "@") || strings.HasSuffix(e.To, "@") || strings.IndexFunc(e.To, notPrintable) >= 0 || strings.ContainsRune(e.To, ' '):
		return errors.New("to: is not an email address (local@domain, printable ASCII, no spaces)")
	case e.Subject == "" || len(e.Subject) > MaxEmailSubject:
		return fmt.Errorf("subject: must be 1 to %d bytes", MaxEmailSubject)
	case e.OrderID == "" || len(e.OrderID) > MaxEmailOrderID || strings.IndexFunc(e.OrderID, notPrintable) >= 0:
		return fmt.Errorf("order_id: must be 1 to %d bytes of printable ASCII", MaxEmailOrderID)
	}
	return nil
}

func notPrintable(r rune) bool { return r > unicode.MaxASCII || !unicode.IsPrint(r) }

// sendEmail stores every request it is given, as a provider without idempotency does:
// the key of its Idemq-Key header (or an older caller's Idempotency-Key) is recorded,
// never honoured, so a receipt sent twice is two rows of fakepay_emails (the fault suite
// counts them).
func (s *Server) sendEmail(w http.ResponseWriter, r *http.Request) {
	ctx := context.WithoutCancel(r.Context())
	received := time.Now()
	key, err := recordedKey(r.Header)
	var f int64
	if err == nil {
		f, err = fence(r.Header)
	}
	var req EmailRequest
	if err == nil {
		dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 64<<10))
		dec.DisallowUnknownFields()
		if err = dec.Decode(&req); err == nil {
			err = req.validate()
		}
	}
	w.Header().Set("Content-Type", "application/json")
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		json.NewEncoder(w).Encode(map[string]string{"error": err.Error()})
		return
	}
	if err := s.work(ctx); err != nil {
		s.internalError(ctx, w, "email request failed", err)
		return
	}
	var fencePtr *int64
	if f > 0 {
		fencePtr = &f
	}
	e := Email{OrderID: req.OrderID}
	if err := s.pool.QueryRow(ctx, `INSERT INTO fakepay_emails (order_id, to_address, subject, idempotency_key, fence, received_at)
		VALUES ($1, $2, $3, nullif($4, ''), $5, $6) RETURNING id`, req.OrderID, req.To, req.Subject, key, fencePtr, received).Scan(&e.ID); err != nil {
		s.internalError(ctx, w, "email request failed", err)
		return
	}
	s.cfg.Logger.InfoContext(ctx, "email request", "key", key, "order_id", req.OrderID, "id", e.ID)
	w.WriteHeader(http.StatusAccepted)
	json.NewEncoder(w).Encode(e)
}

// internalError logs cause and answers 500 without it.
func (s *Server) internalError(ctx context.Context, w http.ResponseWriter, msg string, cause error) {
	s.cfg.Logger.ErrorContext(ctx, msg, "err", cause)
	w.WriteHeader(http.StatusInternalServerError)
	json.NewEncoder(w).Encode(map[string]string{"error": errInternal.Error()})
}
