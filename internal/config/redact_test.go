package config_test

import (
	"errors"
	"net/url"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/config"
)

const secret = "S3cretPW"

// leaks reports whether s shows the password, as written or URL-escaped.
func leaks(s, password string) bool {
	return strings.Contains(s, password) || strings.Contains(s, url.QueryEscape(password)) ||
		strings.Contains(s, url.PathEscape(password))
}

func TestMalformedURLErrorsHideThePassword(t *testing.T) {
	for _, tc := range []struct {
		name, value, want string
		hidden            []string // besides secret: what else must not show (fragments of a password)
	}{
		{"REDIS_URL", "redis://:" + secret + "@127.0.0.1:6379/0?bad=1", "unexpected option: bad", nil},
		{"REDIS_URL", "redis://:" + secret + "@[::1", "missing ']' in host", nil},
		{"REDIS_URL", "redis://user:" + secret + "@host:notaport", `invalid port ":notaport"`, nil},
		{"REDIS_URL", "redis://user:" + secret + "@host:6379/x", "invalid database number", nil},
		{"REDIS_URL", "redis://:" + secret + "@host:notaport" + secret, "invalid port", nil},
		{"REDIS_URL", ":" + secret + "@host:6379", "missing protocol scheme", nil},
		// An unescaped '/' cuts the password: the parser would quote "S3cr" as the port.
		{"REDIS_URL", "redis://:S3cr/etPW@host:6379", "percent-encode", []string{"S3cr", "etPW"}},
		{"REDIS_URL", "redis://u:12/" + secret + "@host:6379", "percent-encode", []string{"12"}},
		{"REDIS_URL", "redis://:S3cr%zzetPW@host:6379", "invalid URL escape", []string{"S3cr", "etPW"}},
		{"REDIS_URL", "redis://:a@127.0.0.1:6379/0?bad=1", "redis: unexpected option: bad", nil}, // a short password mangles no word
		{"REDIS_URL", "redis://:" + url.QueryEscape(secret+" ~@#") + "@host:6379/0?bad=1", "unexpected option: bad", []string{secret + " ~@#"}},
		{"DATABASE_URL", "postgres://u:" + secret + "@[::1/db", "not a valid Postgres URL or DSN: ", nil},
		{"DATABASE_URL", "postgres://u:" + secret + "@host:notaport/db", "not a valid Postgres URL or DSN: ", nil},
		{"DATABASE_URL", "postgres://u@host/db?password=" + secret + "&connect_timeout=x", "connect_timeout", nil},
		{"DATABASE_URL", "host=h password=" + secret + " port=notaport", "not a valid Postgres URL or DSN: ", nil},
	} {
		t.Run(tc.value, func(t *testing.T) {
			t.Setenv("REDIS_URL", "redis://127.0.0.1:6379/0")
			t.Setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
			t.Setenv(tc.name, tc.value)
			err := config.Load(&config.Enqueue{})
			if err == nil {
				t.Fatalf("%s=%s: Load succeeded, want an error", tc.name, tc.value)
			}
			msg := err.Error()
			for _, pw := range append(tc.hidden, secret) {
				if leaks(msg, pw) {
					t.Errorf("error shows %q: %s", pw, msg)
				}
			}
			if !strings.HasPrefix(msg, tc.name+": ") || !strings.Contains(msg, tc.want) {
				t.Errorf("error = %q, want it to start with %q and say %q", msg, tc.name+": ", tc.want)
			}
			if strings.Contains(msg, "\n") {
				t.Errorf("error = %q, want one line", msg)
			}
		})
	}
}

func TestRedactURL(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		{"redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"},
		{"redis://:" + secret + "@127.0.0.1:6379/0", "redis://:xxxxx@127.0.0.1:6379/0"},
		{"redis://user:" + secret + "@h:6379/0?protocol=3", "redis://user:xxxxx@h:6379/0?protocol=3"},
		{"redis://user@h:6379", "redis://user@h:6379"},
		{"postgres://u@h/db?sslmode=disable&password=" + secret, "postgres://u@h/db?sslmode=disable&password=xxxxx"},
		{"redis://:" + secret + "@[::1", "redis://:xxxxx@[::1"},
		{"redis://u:S3c/ret@PW@h:1/0", "redis://u:xxxxx@h:1/0"},
		{"host=h password=" + secret + " dbname=d", "host=h password=xxxxx dbname=d"},
		{"host=h password='S3c ret' dbname=d", "host=h password=xxxxx dbname=d"},
	} {
		if got := config.RedactURL(tc.in); got != tc.want {
			t.Errorf("RedactURL(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestURLErrorIsNotAWrapper(t *testing.T) {
	t.Parallel()
	raw := "redis://:" + secret + "@[::1"
	_, cause := url.Parse(raw)
	err := config.URLError(raw, cause)
	if leaks(err.Error(), secret) {
		t.Fatalf("URLError = %q, shows the password", err)
	}
	if errors.Unwrap(err) != nil {
		t.Fatalf("URLError unwraps to %v: a caller could print the unredacted cause", errors.Unwrap(err))
	}
}
