package store

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgtype"
)

// Text safe to store in Postgres: error text in a text column, JSON in a jsonb one.

// MaxTextBytes is the longest text CleanText returns, plus the "…" that marks a cut.
const MaxTextBytes = 4096

// CleanText makes s storable as Postgres text: valid UTF-8, no NUL, at most MaxTextBytes
// (cut at a rune boundary, marked with "…").
func CleanText(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", "\\x00")
	if len(s) > MaxTextBytes {
		cut := MaxTextBytes
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "…"
	}
	return s
}

// ValidateResult reports why result cannot be stored in a jsonb column within maxBytes:
// too large, not valid UTF-8 JSON, or holding an escape jsonb refuses (\u0000, an
// unpaired surrogate). An empty result is valid (stored as NULL).
func ValidateResult(result []byte, maxBytes int) error {
	if len(result) == 0 {
		return nil
	}
	if len(result) > maxBytes {
		return fmt.Errorf("result too large: %d bytes > limit %d", len(result), maxBytes)
	}
	if !utf8.Valid(result) || !json.Valid(result) {
		return fmt.Errorf("result is not valid JSON (%d bytes)", len(result))
	}
	return CheckJSONEscapes(result)
}

// ResultText is what to store for a handler's result (not valid: NULL) and the last_error
// to record (not valid: none): the result itself, or, when ValidateResult refuses it, an
// error marker (MarkerText) and the reason.
func ResultText(result []byte, maxBytes int) (stored, lastErr pgtype.Text) {
	if len(result) == 0 {
		return pgtype.Text{}, pgtype.Text{}
	}
	if err := ValidateResult(result, maxBytes); err != nil {
		return MarkerText(err.Error())
	}
	return pgtype.Text{String: string(result), Valid: true}, pgtype.Text{}
}

// MarkerText is the error marker stored instead of a result that cannot be stored,
// {"idemq_error": msg}, and msg, cleaned, as the last_error.
func MarkerText(msg string) (stored, lastErr pgtype.Text) {
	msg = CleanText(msg)
	b, _ := json.Marshal(map[string]string{"idemq_error": msg})
	return pgtype.Text{String: string(b), Valid: true}, pgtype.Text{String: msg, Valid: true}
}

// CheckJSONEscapes finds the \u escapes in valid JSON that jsonb refuses (\u0000, an
// unpaired surrogate). In valid JSON a backslash only occurs inside strings, starting an
// escape.
func CheckJSONEscapes(b []byte) error {
	for i := 0; i < len(b); i++ {
		if b[i] != '\\' {
			continue
		}
		i++
		if b[i] != 'u' {
			continue
		}
		r := hexRune(b[i+1 : i+5])
		i += 4
		switch {
		case r == 0:
			return fmt.Errorf("result holds \\u0000, which jsonb cannot store")
		case r >= 0xD800 && r <= 0xDBFF:
			if i+6 < len(b) && b[i+1] == '\\' && b[i+2] == 'u' {
				if lo := hexRune(b[i+3 : i+7]); lo >= 0xDC00 && lo <= 0xDFFF {
					i += 6
					continue
				}
			}
			return fmt.Errorf("result holds an unpaired surrogate escape, which jsonb cannot store")
		case r >= 0xDC00 && r <= 0xDFFF:
			return fmt.Errorf("result holds an unpaired surrogate escape, which jsonb cannot store")
		}
	}
	return nil
}

func hexRune(h []byte) rune {
	var r rune
	for _, c := range h {
		r <<= 4
		switch {
		case c >= '0' && c <= '9':
			r |= rune(c - '0')
		case c >= 'a' && c <= 'f':
			r |= rune(c - 'a' + 10)
		case c >= 'A' && c <= 'F':
			r |= rune(c - 'A' + 10)
		}
	}
	return r
}
