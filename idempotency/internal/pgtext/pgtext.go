// Package pgtext makes text safe to store in Postgres: error text in a text column, JSON
// in a jsonb one.
package pgtext

import (
	"strings"
	"unicode/utf8"
)

// MaxBytes is the longest text Clean returns, plus the "…" that marks a cut.
const MaxBytes = 4096

// Clean makes s storable as Postgres text: valid UTF-8, no NUL, at most MaxBytes (cut at
// a rune boundary, marked with "…").
func Clean(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", "\\x00")
	if len(s) > MaxBytes {
		cut := MaxBytes
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "…"
	}
	return s
}
