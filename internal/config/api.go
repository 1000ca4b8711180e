package config

import (
	"fmt"
	"strings"
)

// The length bounds of one API token.
const (
	MinAPITokenLen = 32
	MaxAPITokenLen = 256
)

// placeholderToken is the value that counts as no token, as for the dashboard's password.
const placeholderToken = "change-me"

// APITokens splits IDEMQ_API_TOKEN at its commas: the tokens /v1/ admits. Empty entries
// and the placeholder change-me are dropped; nil means no token.
func APITokens(v string) []string {
	var out []string
	for _, t := range strings.Split(v, ",") {
		if t = strings.TrimSpace(t); t != "" && t != placeholderToken {
			out = append(out, t)
		}
	}
	return out
}

// checkAPIToken checks each token of IDEMQ_API_TOKEN without ever quoting one: the error
// says which token (by position) breaks which rule.
func checkAPIToken(v string) error {
	if strings.TrimSpace(v) == "" || strings.TrimSpace(v) == placeholderToken {
		return nil
	}
	entries := strings.Split(v, ",")
	for i, t := range entries {
		t = strings.TrimSpace(t)
		which := "the token"
		if len(entries) > 1 {
			which = fmt.Sprintf("token %d of %d", i+1, len(entries))
		}
		switch {
		case t == "":
			return fmt.Errorf("%s is empty", which)
		case t == placeholderToken:
			return fmt.Errorf("%s is the placeholder %s", which, placeholderToken)
		case len(t) < MinAPITokenLen || len(t) > MaxAPITokenLen:
			return fmt.Errorf("%s has %d characters; each must have %d to %d", which, len(t), MinAPITokenLen, MaxAPITokenLen)
		case strings.IndexFunc(t, func(r rune) bool { return !tokenChar(r) }) >= 0:
			return fmt.Errorf("%s has a character outside A-Z a-z 0-9 . _ ~ + / = -", which)
		}
	}
	return nil
}

// tokenChar reports whether r may appear in an API token: the characters of RFC 6750's
// b64token.
func tokenChar(r rune) bool {
	return r >= 'A' && r <= 'Z' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || strings.ContainsRune("._~+/=-", r)
}
