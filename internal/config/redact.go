package config

import (
	"errors"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// mask stands in for a credential in messages, as in url.URL.Redacted.
const mask = "xxxxx"

// passwordParam matches a password given as a query parameter of a URL or as a keyword of
// a Postgres key=value DSN (password, sslpassword; quoted or not). Group 1 is the value.
var passwordParam = regexp.MustCompile(`(?i)(?:^|[?&\s])(?:ssl)?password\s*=\s*('(?:[^'\\]|\\.)*'|[^&\s#]*)`)

// RedactURL returns raw, a URL or a Postgres key=value DSN, with its credentials masked,
// for messages: the password of the userinfo and password or sslpassword parameters become
// "xxxxx"; the user name stays. It works on text url.Parse refuses too: the userinfo is
// taken to end at the last '@', so a URL with an '@' elsewhere may be over-masked.
func RedactURL(raw string) string {
	s := raw
	if pw, ok := userinfoPassword(raw); ok {
		i := strings.LastIndexByte(raw, '@')
		s = raw[:i-len(pw)] + mask + raw[i:]
	}
	return passwordParam.ReplaceAllStringFunc(s, func(m string) string {
		v := passwordParam.FindStringSubmatch(m)[1]
		return m[:len(m)-len(v)] + mask
	})
}

// URLError returns err, an error about raw (the value of a URL- or DSN-valued setting),
// as a new error whose text keeps what is wrong but shows none of raw's credentials, in
// any spelling (as written, escaped, unescaped or quoted): a *url.Error's URL is
// redacted, and every password that raw holds is masked wherever the text repeats it.
//
// When an unescaped '/', '?', '#' or '@' in the userinfo makes it unclear where the
// password ends, the parser may quote any piece of it, so the text of err is dropped for
// a fixed hint. The result does not wrap err, whose text may show the password.
func URLError(raw string, err error) error {
	if _, ok := userinfoPassword(raw); ok && strings.ContainsAny(userinfo(raw), "/?#@") {
		return errors.New("not a valid URL; percent-encode any '/', '?', '#' or '@' in its user name or password")
	}
	msg := err.Error()
	var ue *url.Error
	if errors.As(err, &ue) {
		redacted := &url.Error{Op: ue.Op, URL: RedactURL(ue.URL), Err: ue.Err}
		msg = strings.ReplaceAll(msg, ue.Error(), redacted.Error())
	}
	for _, s := range spellings(secrets(raw)) {
		msg = maskAll(msg, s)
	}
	return errors.New(msg)
}

// maskAll replaces secret in msg by mask: everywhere when it is 4 bytes or longer, else
// only where no letter or digit touches it, so a short password does not mangle words.
func maskAll(msg, secret string) string {
	if len(secret) >= 4 {
		return strings.ReplaceAll(msg, secret, mask)
	}
	var b strings.Builder
	for {
		i := strings.Index(msg, secret)
		if i < 0 {
			b.WriteString(msg)
			return b.String()
		}
		end := i + len(secret)
		if (i > 0 && isAlnum(msg[i-1])) || (end < len(msg) && isAlnum(msg[end])) {
			b.WriteString(msg[:i+1])
			msg = msg[i+1:]
			continue
		}
		b.WriteString(msg[:i] + mask)
		msg = msg[end:]
	}
}

func isAlnum(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9'
}

// userinfo returns the part of raw before its last '@' (after "scheme://" if it has one),
// or "" without an '@'.
func userinfo(raw string) string {
	i := strings.LastIndexByte(raw, '@')
	if i < 0 {
		return ""
	}
	start := 0
	if j := strings.Index(raw, "://"); j >= 0 && j < i {
		start = j + len("://")
	}
	return raw[start:i]
}

// userinfoPassword returns the password of raw's userinfo as written: what follows the
// first ':' of userinfo(raw).
func userinfoPassword(raw string) (string, bool) {
	_, pw, ok := strings.Cut(userinfo(raw), ":")
	return pw, ok && pw != ""
}

// secrets lists the passwords raw holds, as written.
func secrets(raw string) []string {
	var out []string
	if pw, ok := userinfoPassword(raw); ok {
		out = append(out, pw)
	}
	for _, m := range passwordParam.FindAllStringSubmatch(raw, -1) {
		if v := strings.Trim(m[1], "'"); v != "" {
			out = append(out, v, m[1])
		}
	}
	return out
}

// spellings returns each secret as written, unescaped, escaped and quoted, longest first
// (so that masking one spelling never leaves part of a longer one).
func spellings(secrets []string) []string {
	var out []string
	add := func(s string) {
		if s != "" && !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	for _, s := range secrets {
		forms := []string{s, url.QueryEscape(s), url.PathEscape(s), url.UserPassword("", s).String()[1:]}
		if u, err := url.PathUnescape(s); err == nil {
			forms = append(forms, u)
		}
		if u, err := url.QueryUnescape(s); err == nil {
			forms = append(forms, u)
		}
		for _, f := range forms {
			add(f)
			add(strings.Trim(strconv.Quote(f), `"`))
		}
	}
	slices.SortFunc(out, func(a, b string) int { return len(b) - len(a) })
	return out
}
