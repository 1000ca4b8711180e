package tasks

import (
	"fmt"
	"strings"
	"testing"
)

// The decoders as they were before decodePlain: decodeStrict alone, then Validate.
func strictDebit(payload []byte) (Debit, error) {
	d, err := decodeStrict[Debit](payload)
	if err != nil {
		return Debit{}, err
	}
	return d, d.Validate()
}

func strictCharge(payload []byte) (Charge, error) {
	c, err := decodeStrict[Charge](payload)
	if err != nil {
		return Charge{}, err
	}
	c = c.Canonical()
	return c, c.Validate()
}

// plainSeeds are payloads near the edge of what decodePlain takes, and the refusals the
// package's tests make.
var plainSeeds = []string{
	`{"account_id":"a-1","amount_cents":250,"reference":"r-9"}`,
	" \t\r\n{ \"account_id\" : \"a\" ,\n\"amount_cents\":\t1 , \"reference\":\"r\" } \n",
	`{"reference":"r","account_id":"a","amount_cents":99999999999}`,
	`{"account_id":"a","amount_cents":100000000000,"reference":"r"}`,
	`{"account_id":"a","amount_cents":999999999999999999,"reference":"r"}`,
	`{"account_id":"a","amount_cents":9999999999999999999,"reference":"r"}`,
	`{"account_id":"a","amount_cents":9223372036854775808,"reference":"r"}`,
	`{"account_id":"a","amount_cents":0,"reference":"r"}`,
	`{"account_id":"a","amount_cents":-0,"reference":"r"}`,
	`{"account_id":"a","amount_cents":-5,"reference":"r"}`,
	`{"account_id":"a","amount_cents":01,"reference":"r"}`,
	`{"account_id":"a","amount_cents":1.0,"reference":"r"}`,
	`{"account_id":"a","amount_cents":1e3,"reference":"r"}`,
	`{"account_id":"a","amount_cents":"1","reference":"r"}`,
	`{"account_id":"a","amount_cents":null,"reference":"r"}`,
	`{"account_id":null,"amount_cents":1,"reference":"r"}`,
	`{"account_id":1,"amount_cents":1,"reference":"r"}`,
	`{"account_id":"a b","amount_cents":1,"reference":"r"}`,
	`{"account_id":"a\u0062","amount_cents":1,"reference":"r"}`,
	`{"account_id":"ö","amount_cents":1,"reference":"r"}`,
	"{\"account_id\":\"a\x7f\",\"amount_cents\":1,\"reference\":\"r\"}",
	"{\"account_id\":\"a\x01\",\"amount_cents\":1,\"reference\":\"r\"}",
	"{\"account_id\":\"\xff\",\"amount_cents\":1,\"reference\":\"r\"}",
	`{"account_id":"","amount_cents":1,"reference":"r"}`,
	`{"account_id":"a","amount_cents":1}`,
	`{"account_id":"a","amount_cents":1,"reference":"r","x":true}`,
	`{"account_id":"a","amount_cents":1,"reference":"r","reference":"s"}`,
	`{"account_id":"a","amount_cents":1,"reference":"r","\u0072eference":"s"}`,
	`{"account_id":"a","amount_cents":1,"REFERENCE":"r"}`,
	`{"account_id":"a","amount_centſ":1,"reference":"r"}`,
	`{"account_id":"a","amount_cents":1,"reference":"r"} {}`,
	`{"account_id":"a","amount_cents":1,"reference":"r"}x`,
	`{"account_id":"a","amount_cents":1,"reference":"r",}`,
	`{"account_id":"a","amount_cents":1,"reference":"r"`,
	`{"account_id":"a","amount_cents":1 "reference":"r"}`,
	`{"account_id" "a"}`,
	`{"account_id":"a",,"amount_cents":1}`,
	`{,}`, `{}`, `{ }`, `{`, `}`, `[]`, `null`, ``, ` `, `"x"`, `1`,
	"\ufeff{}",
	`{"order_id":"o-1","customer_id":"c-1","amount_cents":1999,"currency":"EUR"}`,
	`{"order_id":"o-1","customer_id":"c-1","amount_cents":1999,"currency":"usd"}`,
	`{"order_id":"o","customer_id":"c","amount_cents":1,"currency":"uſd"}`,
	`{"order_id":"o","customer_id":"c","amount_cents":1,"currency":"E1R"}`,
	`{"order_id":"o","customer_id":"c","amount_cents":1,"currency":"EUR","currency":"USD"}`,
	`{"Order_ID":"o","order_id":"o","customer_id":"c","amount_cents":1,"currency":"EUR"}`,
	`{"order_id":"` + strings.Repeat("x", 249) + `","customer_id":"c","amount_cents":1,"currency":"EUR"}`,
	`{"account_id":"a","amount_cents":1,"reference":"` + strings.Repeat("r", 1<<16) + `"}`,
}

// TestDecodePlainAgreesWithStrict: for every seed, DecodeDebit and DecodeCharge answer as
// decodeStrict and Validate do, value and error alike; and the plain payloads take the
// one-pass path.
func TestDecodePlainAgreesWithStrict(t *testing.T) {
	t.Parallel()
	for _, s := range plainSeeds {
		checkAgrees(t, []byte(s))
	}
	for _, s := range []string{
		`{"account_id":"a-1","amount_cents":250,"reference":"r-9"}`,
		`{}`,
		` { "reference" : "r" } `,
	} {
		if !decodePlain([]byte(s), new(Debit).fields()) {
			t.Errorf("decodePlain(%s) = false, want a plain payload", s)
		}
	}
	if !decodePlain([]byte(`{"order_id":"o","customer_id":"c","amount_cents":1,"currency":"eur"}`), new(Charge).fields()) {
		t.Error("decodePlain refused a plain charge")
	}
}

func FuzzDecodePlainAgreesWithStrict(f *testing.F) {
	for _, s := range plainSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, payload []byte) { checkAgrees(t, payload) })
}

func checkAgrees(t *testing.T, payload []byte) {
	t.Helper()
	d, err := DecodeDebit(payload)
	wd, werr := strictDebit(payload)
	if d != wd || fmt.Sprint(err) != fmt.Sprint(werr) {
		t.Errorf("DecodeDebit(%.80q) = %+v, %v; decodeStrict gives %+v, %v", payload, d, err, wd, werr)
	}
	c, err := DecodeCharge(payload)
	wc, werr := strictCharge(payload)
	if c != wc || fmt.Sprint(err) != fmt.Sprint(werr) {
		t.Errorf("DecodeCharge(%.80q) = %+v, %v; decodeStrict gives %+v, %v", payload, c, err, wc, werr)
	}
}
