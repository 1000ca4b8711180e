package idempotency

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"slices"
	"strings"
	"sync"
	"unicode"
)

// DecodeStrict decodes the JSON object payload into a T (a struct) and refuses, with an
// error that names the problem, what encoding/json would let through: a payload over
// MaxPayloadBytes, a field T does not have, a field sent twice or under a case variant
// of its name (see CheckFieldNames), a value of the wrong type (the error names the
// field and quotes at most 24 bytes of the value), and data after the object. It only
// decodes: validating the fields is the caller's. A refusal is permanent: a task whose
// payload it refuses can never run, so asynqmw archives it with the reason.
//
// An error for a value of the wrong type wraps the *json.UnmarshalTypeError. DecodeStrict
// is safe for concurrent use.
func DecodeStrict[T any](payload []byte) (T, error) {
	var v T
	if len(payload) > MaxPayloadBytes {
		return v, fmt.Errorf("payload is %d bytes; the limit is %d", len(payload), MaxPayloadBytes)
	}
	if err := CheckFieldNames(payload, &v); err != nil {
		return v, err
	}
	dec := json.NewDecoder(bytes.NewReader(payload))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) && typeErr.Field != "" {
			err = fieldTypeError{typeErr}
		}
		var zero T
		return zero, fmt.Errorf("malformed payload: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		var zero T
		return zero, errors.New("malformed payload: data after the JSON object")
	}
	return v, nil
}

// fieldTypeError is a JSON value of the wrong type (or out of range) for a field, named
// by the field: "amount_cents: must be a JSON whole number, got string".
type fieldTypeError struct{ e *json.UnmarshalTypeError }

func (f fieldTypeError) Unwrap() error { return f.e }

func (f fieldTypeError) Error() string {
	got := f.e.Value
	if num, ok := strings.CutPrefix(got, "number "); ok {
		got = "number " + cutValue(num)
	}
	want := f.e.Type.Kind().String()
	switch f.e.Type.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		want = "whole number"
	case reflect.Float32, reflect.Float64:
		want = "number"
	}
	return fmt.Sprintf("%s: must be a JSON %s, got %s", f.e.Field, want, got)
}

// cutValue is v cut to 24 bytes, followed by its length when it was longer, so that an
// error never echoes a huge value back.
func cutValue(v string) string {
	if len(v) <= 24 {
		return v
	}
	return fmt.Sprintf("%s… (%d characters)", v[:24], len(v))
}

// CheckFieldNames reports the first top-level field of the JSON object payload that
// appears more than once, or that encoding/json would decode into a field of v although
// its name is not exactly that field's. encoding/json lets the last of two equal names
// win, and matches names case-insensitively with Unicode folding, so that "REFERENCE",
// "Reference" and, with a long s, "amount_centſ" fill reference and amount_cents. The
// error names the field as sent.
//
// It checks nothing else: malformed JSON, a payload that is not an object and unknown
// fields are left to the decoder (with DisallowUnknownFields), and nested values are not
// looked into. v is a struct or a pointer to one; its names are its exported fields' json
// names (embedded structs are not looked into). It is safe for concurrent use.
func CheckFieldNames(payload []byte, v any) error {
	names := jsonNames(reflect.TypeOf(v))
	dec := json.NewDecoder(bytes.NewReader(payload))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil
	}
	// The whole object is read before the first problem is reported, so that malformed
	// JSON is reported as such by the decoder.
	var first error
	seen := make(map[string]bool, len(names))
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil
		}
		key, _ := tok.(string)
		switch {
		case first != nil:
		case seen[key]:
			first = fmt.Errorf("%s: duplicate field (each field may appear once)", fieldLabel(key))
		case !slices.Contains(names, key):
			for _, name := range names {
				if strings.EqualFold(key, name) {
					first = fmt.Errorf("%s: field names are case-sensitive (did you mean %q?)", fieldLabel(key), name)
					break
				}
			}
		}
		seen[key] = true
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return nil
		}
	}
	if _, err := dec.Token(); err != nil { // the closing '}'
		return nil
	}
	return first
}

var namesByType sync.Map // reflect.Type → []string

// jsonNames returns the json names of t's exported fields (t a struct or a pointer to
// one), those of its embedded structs included, or nil.
func jsonNames(t reflect.Type) []string {
	if t == nil {
		return nil
	}
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct {
		return nil
	}
	if names, ok := namesByType.Load(t); ok {
		return names.([]string)
	}
	var names []string
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		name, _, _ := strings.Cut(tag, ",")
		ft := f.Type
		if ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		if f.Anonymous && name == "" && tag != "-" && ft.Kind() == reflect.Struct {
			// An embedded struct without a name: its fields are the payload's, as
			// encoding/json promotes them.
			names = append(names, jsonNames(ft)...)
			continue
		}
		if !f.IsExported() || tag == "-" {
			continue
		}
		if name == "" {
			name = f.Name
		}
		names = append(names, name)
	}
	namesByType.Store(t, names)
	return names
}

// fieldLabel is key as an error names it: as sent when it is short and printable, else
// quoted and cut to 64 characters.
func fieldLabel(key string) string {
	odd := func(r rune) bool { return !unicode.IsGraphic(r) || unicode.IsSpace(r) || r == '"' }
	if key == "" || len(key) > 64 || strings.ContainsFunc(key, odd) {
		return fmt.Sprintf("%.64q", key)
	}
	return key
}
