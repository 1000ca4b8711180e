package main

import (
	"net/url"
	"strings"
	"testing"
)

// TestMalformedURLDoesNotPrintItsPassword starts subcommands with a REDIS_URL or
// DATABASE_URL that does not parse and holds a password: the program stops with one line
// naming the variable and what is wrong, and never prints the password.
func TestMalformedURLDoesNotPrintItsPassword(t *testing.T) {
	t.Parallel()
	const pw = "S3cretPW"
	for _, tc := range []struct{ cmd, env, want string }{
		{"enqueue", "REDIS_URL=redis://:" + pw + "@127.0.0.1:6379/0?bad=1", "REDIS_URL: redis: unexpected option: bad"},
		{"worker", "REDIS_URL=redis://:" + pw + "@[::1", "REDIS_URL: parse \"redis://:xxxxx@[::1\": missing ']' in host"},
		{"api", "REDIS_URL=redis://user:" + pw + "@host:notaport", `REDIS_URL: parse "redis://user:xxxxx@host:notaport": invalid port ":notaport" after host`},
		{"migrate", "DATABASE_URL=postgres://user:" + pw + "@host:notaport/db", "DATABASE_URL: not a valid Postgres URL or DSN: "},
		{"fakepay", "DATABASE_URL=postgres://user:" + pw + "@[::1/db", "DATABASE_URL: not a valid Postgres URL or DSN: "},
		{"worker", "IDEMQ_DIRECT_DATABASE_URL=postgres://user:" + pw + "@host:notaport/db", "IDEMQ_DIRECT_DATABASE_URL: not a valid Postgres URL or DSN: "},
	} {
		_, stderr, err := idemq(t, []string{tc.env}, tc.cmd)
		if err == nil {
			t.Fatalf("idemq %s with %s: exit 0, want a failure", tc.cmd, tc.env)
		}
		if strings.Contains(stderr, pw) || strings.Contains(stderr, url.QueryEscape(pw)) {
			t.Errorf("idemq %s with %s prints the password: %q", tc.cmd, tc.env, stderr)
		}
		lines := strings.Split(strings.TrimSpace(stderr), "\n")
		if len(lines) != 1 || !strings.Contains(lines[0], tc.want) {
			t.Errorf("idemq %s with %s: stderr %q, want one line containing %q", tc.cmd, tc.env, stderr, tc.want)
		}
	}
}
