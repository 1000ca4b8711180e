package pgtext

import "fmt"

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
