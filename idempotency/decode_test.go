package idempotency_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/idemq/idemq/idempotency"
)

// debit is a payload with the field names of the example's wallet:debit.
type debit struct {
	AccountID   string `json:"account_id"`
	AmountCents int64  `json:"amount_cents"`
	Reference   string `json:"reference"`
}

func TestCheckFieldNames(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("k", 100)
	for _, tc := range []struct {
		name, payload, wantErr string // wantErr "" for none
	}{
		{"exact names", `{"account_id":"a","amount_cents":1,"reference":"r"}`, ""},
		{"any order, some missing", `{"reference":"r","account_id":"a"}`, ""},
		{"empty object", `{}`, ""},
		{"upper case", `{"REFERENCE":"r"}`, `REFERENCE: field names are case-sensitive (did you mean "reference"?)`},
		{"mixed case", `{"Account_Id":"a"}`, `Account_Id: field names are case-sensitive (did you mean "account_id"?)`},
		{"long s", `{"amount_centſ":1}`, `amount_centſ: field names are case-sensitive (did you mean "amount_cents"?)`},
		{"escaped variant", `{"\u0052eference":"r"}`, `Reference: field names are case-sensitive`},
		{"duplicate", `{"reference":"a","reference":"b"}`, `reference: duplicate field`},
		{"duplicate after others", `{"reference":"a","account_id":"x","amount_cents":1,"reference":"a"}`, `reference: duplicate field`},
		{"escaped duplicate", `{"reference":"a","\u0072eference":"b"}`, `reference: duplicate field`},
		{"the first problem is named", `{"REFERENCE":"a","reference":"b","reference":"c"}`, `REFERENCE: field names`},
		{"duplicate unknown", `{"x":1,"x":2}`, `x: duplicate field`},
		{"odd duplicate is quoted", `{"a b":1,"a b":2}`, `"a b": duplicate field`},
		{"long duplicate is cut", `{"` + long + `":1,"` + long + `":2}`, `"` + strings.Repeat("k", 64) + `": duplicate field`},
		{"empty name duplicate", `{"":1,"":2}`, `"": duplicate field`},
		// Left to the decoder.
		{"unknown", `{"x":1,"referenſe":2}`, ""},
		{"nested duplicates", `{"reference":{"reference":1,"reference":2,"REFERENCE":3},"account_id":[{"a":1,"a":1}]}`, ""},
		{"names as values", `{"reference":"REFERENCE","account_id":"reference"}`, ""},
		{"malformed", `{"reference":"a","reference":`, ""},
		{"malformed after a variant", `{"REFERENCE":"a",}`, ""},
		{"not an object", `["reference","reference"]`, ""},
		{"empty", ``, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, v := range []any{debit{}, &debit{}} {
				err := idempotency.CheckFieldNames([]byte(tc.payload), v)
				switch {
				case tc.wantErr == "" && err != nil:
					t.Fatalf("CheckFieldNames(%s, %T) = %v, want nil", tc.payload, v, err)
				case tc.wantErr != "" && (err == nil || !strings.HasPrefix(err.Error(), tc.wantErr)):
					t.Fatalf("CheckFieldNames(%s, %T) = %v, want an error starting %q", tc.payload, v, err, tc.wantErr)
				}
			}
		})
	}
	// Without a struct, only duplicates are refused.
	if err := idempotency.CheckFieldNames([]byte(`{"A":1,"a":2}`), map[string]int{}); err != nil {
		t.Fatalf("map: %v, want nil", err)
	}
	if err := idempotency.CheckFieldNames([]byte(`{"a":1,"a":2}`), nil); err == nil {
		t.Fatal("nil v: a duplicate passed")
	}
}

func TestDecodeStrict(t *testing.T) {
	t.Parallel()
	got, err := idempotency.DecodeStrict[debit]([]byte(` {"reference":"r","account_id":"a","amount_cents":7} `))
	if want := (debit{AccountID: "a", AmountCents: 7, Reference: "r"}); err != nil || got != want {
		t.Fatalf("DecodeStrict = %+v, %v; want %+v", got, err, want)
	}
	for _, tc := range []struct {
		name, payload, wantErr string
	}{
		{"unknown field", `{"account_id":"a","amount_cents":1,"reference":"r","x":1}`, `malformed payload: json: unknown field "x"`},
		{"trailing object", `{"account_id":"a","amount_cents":1,"reference":"r"} {}`, `malformed payload: data after the JSON object`},
		{"trailing garbage", `{"account_id":"a","amount_cents":1,"reference":"r"} x`, `malformed payload: data after the JSON object`},
		{"duplicate", `{"account_id":"a","amount_cents":1,"reference":"r","reference":"s"}`, `reference: duplicate field`},
		{"case variant", `{"account_id":"a","amount_cents":1,"Reference":"r"}`, `Reference: field names are case-sensitive (did you mean "reference"?)`},
		{"wrong type", `{"account_id":"a","amount_cents":"1","reference":"r"}`, `malformed payload: amount_cents: must be a JSON whole number, got string`},
		{"fraction", `{"account_id":"a","amount_cents":1.5,"reference":"r"}`, `malformed payload: amount_cents: must be a JSON whole number, got number 1.5`},
		{"huge number is cut", `{"account_id":"a","amount_cents":` + strings.Repeat("9", 40) + `,"reference":"r"}`, `got number 999999999999999999999999… (40 characters)`},
		{"not an object", `[1]`, `malformed payload: json: cannot unmarshal array into Go value of type idempotency_test.debit`},
		{"empty", ``, `malformed payload: EOF`},
		{"malformed", `{"account_id":`, `malformed payload: `},
		{"too large", `{"reference":"` + strings.Repeat("r", idempotency.MaxPayloadBytes) + `"}`, `payload is 65552 bytes; the limit is 65536`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := idempotency.DecodeStrict[debit]([]byte(tc.payload))
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("DecodeStrict(%.80s) = %v, want an error containing %q", tc.payload, err, tc.wantErr)
			}
			if got != (debit{}) {
				t.Fatalf("DecodeStrict(%.80s) returned %+v with its error, want the zero value", tc.payload, got)
			}
		})
	}
	// A value of the wrong type wraps encoding/json's error, for callers that word it
	// their own way.
	_, err = idempotency.DecodeStrict[debit]([]byte(`{"account_id":1}`))
	var typeErr *json.UnmarshalTypeError
	if !errors.As(err, &typeErr) || typeErr.Field != "account_id" {
		t.Fatalf("DecodeStrict type error = %v, want one wrapping *json.UnmarshalTypeError for account_id", err)
	}
}

// TestDecodeStrictEmbedded: the fields of an embedded struct are the payload's, as
// encoding/json promotes them; a misspelt one is still refused.
func TestDecodeStrictEmbedded(t *testing.T) {
	t.Parallel()
	type tick struct {
		Entry string `json:"entry"`
	}
	type job struct {
		tick
		debit  `json:"debit"`
		Period string `json:"period"`
	}
	v, err := idempotency.DecodeStrict[job]([]byte(`{"entry":"e","period":"1h","debit":{"account_id":"a"}}`))
	if err != nil || v.Entry != "e" || v.Period != "1h" {
		t.Fatalf("DecodeStrict: %+v %v", v, err)
	}
	for payload, want := range map[string]string{
		`{"Entry":"e","period":"1h"}`:          `"entry"`,
		`{"entry":"e","account_id":"a"}`:       "account_id",
		`{"entry":"e","period":"1h","x":true}`: `x`,
	} {
		if _, err := idempotency.DecodeStrict[job]([]byte(payload)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error naming %s", payload, err, want)
		}
	}
}
