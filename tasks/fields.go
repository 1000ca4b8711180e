package tasks

import (
	"bytes"
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"unicode"
)

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
// one), or nil.
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
		if !f.IsExported() || tag == "-" {
			continue
		}
		name, _, _ := strings.Cut(tag, ",")
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
