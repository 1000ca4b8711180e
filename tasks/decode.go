package tasks

import "github.com/idemq/idemq/idempotency"

// field is one field of a payload for decodePlain: its JSON name and where its value
// goes, a string or a whole number.
type field struct {
	name string
	str  *string
	num  *int64
}

// decodePlain decodes payload into fields in one pass, when payload is plain: within
// idempotency.MaxPayloadBytes, a JSON object with nothing after it but white space, whose
// names are exactly the fields' names, each at most once, and whose values are strings of
// printable ASCII without escapes (for a string field) or whole numbers of at most 18
// digits without a sign (for a number field). Every plain payload decodes as decodeStrict
// decodes it, to the same values; a payload decodePlain reports false for (it may have
// set some fields) is left to decodeStrict, which accepts or refuses it and says why.
// That is the rare case: the constructors and the API write plain payloads.
func decodePlain(payload []byte, fields []field) bool {
	if len(payload) > idempotency.MaxPayloadBytes || len(fields) > 64 {
		return false
	}
	p := payload
	i := skipSpace(p, 0)
	if i == len(p) || p[i] != '{' {
		return false
	}
	i = skipSpace(p, i+1)
	if i < len(p) && p[i] == '}' {
		return skipSpace(p, i+1) == len(p)
	}
	var seen uint64
	for {
		name, next, ok := plainString(p, i)
		if !ok {
			return false
		}
		f := -1
		for j := range fields {
			if fields[j].name == string(name) {
				f = j
				break
			}
		}
		if f < 0 || seen&(1<<f) != 0 {
			return false // unknown, a case variant or a duplicate
		}
		seen |= 1 << f
		i = skipSpace(p, next)
		if i == len(p) || p[i] != ':' {
			return false
		}
		i = skipSpace(p, i+1)
		if fields[f].str != nil {
			s, next, ok := plainString(p, i)
			if !ok {
				return false
			}
			*fields[f].str = string(s)
			i = next
		} else {
			n, next, ok := plainNumber(p, i)
			if !ok {
				return false
			}
			*fields[f].num = n
			i = next
		}
		i = skipSpace(p, i)
		if i == len(p) {
			return false
		}
		switch p[i] {
		case ',':
			i = skipSpace(p, i+1)
		case '}':
			return skipSpace(p, i+1) == len(p)
		default:
			return false
		}
	}
}

// skipSpace returns the index of the first byte of p at or after i that is not JSON
// white space.
func skipSpace(p []byte, i int) int {
	for i < len(p) && (p[i] == ' ' || p[i] == '\t' || p[i] == '\n' || p[i] == '\r') {
		i++
	}
	return i
}

// plainString reads the JSON string at p[i] when it holds printable ASCII only and no
// escape, returning its contents and the index after its closing quote.
func plainString(p []byte, i int) (s []byte, next int, ok bool) {
	if i == len(p) || p[i] != '"' {
		return nil, 0, false
	}
	for j := i + 1; j < len(p); j++ {
		switch c := p[j]; {
		case c == '"':
			return p[i+1 : j], j + 1, true
		case c < 0x20 || c > 0x7e || c == '\\':
			return nil, 0, false
		}
	}
	return nil, 0, false
}

// plainNumber reads the JSON number at p[i] when it is a whole number without a sign, of
// at most 18 digits (so below 2^63), returning it and the index after it. A fraction or
// an exponent after the digits is left for the caller to refuse.
func plainNumber(p []byte, i int) (n int64, next int, ok bool) {
	j := i
	for j < len(p) && '0' <= p[j] && p[j] <= '9' {
		n = n*10 + int64(p[j]-'0')
		j++
	}
	if digits := j - i; digits == 0 || digits > 18 || digits > 1 && p[i] == '0' {
		return 0, 0, false
	}
	return n, j, true
}
