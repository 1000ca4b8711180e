package api

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"
)

// TestHeaderKeyMismatchHidesJob: the 422 for an Idempotency-Key reused with another body
// does not tell this caller which job the key's first request made.
func TestHeaderKeyMismatchHidesJob(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	a.do(t, "POST", "/v1/charges", chargeBody("o-secret", 1999), "Idempotency-Key", "k-1").want(t, 202)
	ans := a.do(t, "POST", "/v1/charges", chargeBody("o-2", 1999), "Idempotency-Key", "k-1")
	ans.wantError(t, 422, `Idempotency-Key "k-1" was used with a different body`)
	if strings.Contains(ans.body, "o-secret") {
		t.Fatalf("the 422 names the other request's job: %s", ans.body)
	}
}

// TestQuotedHeaderKeyIsSFString: a quoted Idempotency-Key is an RFC 8941 sf-string, whose
// only escapes are \" and \\; anything else is refused instead of being read as Go syntax
// (where "a\x41" would be the key aA).
func TestQuotedHeaderKeyIsSFString(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	for _, tc := range []struct{ header, msg string }{
		{`"a\x41"`, `only \" and \\ may be escaped`},
		{`"a\u0041"`, `only \" and \\ may be escaped`},
		{`"a\n"`, `only \" and \\ may be escaped`},
		{`"a\"`, "no closing quote"},
		{`"abc`, "no closing quote"},
		{`"a"b"`, "after the closing quote"},
		{`"a";p=1`, "after the closing quote"},
		{"\"a\tb\"", "not printable ASCII"},
		{"\"caf\xc3\xa9\"", "not printable ASCII"},
	} {
		t.Run(tc.header, func(t *testing.T) {
			a.do(t, "POST", "/v1/charges", chargeBody("o-1", 5), "Idempotency-Key", tc.header).wantError(t, 400, tc.msg)
		})
	}
	if n := a.intents(t, "charge:o-1"); n != 0 {
		t.Fatalf("%d intents recorded by refused headers, want 0", n)
	}
	// The escapes RFC 8941 has decode to the bare key: one key, replayed.
	for i, pair := range [][2]string{{`a"b`, `"a\"b"`}, {`a\b`, `"a\\b"`}, {`aA`, `"aA"`}} {
		body := chargeBody(fmt.Sprintf("o-%d", i+2), 5)
		first := a.do(t, "POST", "/v1/charges", body, "Idempotency-Key", pair[0]).want(t, 202)
		again := a.do(t, "POST", "/v1/charges", body, "Idempotency-Key", pair[1]).want(t, 202)
		if again.header.Get(HeaderReplayed) != "true" || again.body != first.body {
			t.Fatalf("%s after %s: %q (replayed %q), want the replay of %q", pair[1], pair[0], again.body, again.header.Get(HeaderReplayed), first.body)
		}
	}
}

// TestTooLargeClosesConnection: after a 413 the server closes the connection rather than
// reading the rest of the oversized body and waiting for another request on it.
func TestTooLargeClosesConnection(t *testing.T) {
	t.Parallel()
	a := newTestAPI(t, nil)
	conn, err := net.Dial("tcp", a.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// Just over the limit: small enough that the server would otherwise read the rest.
	body := `{"order_id":"` + strings.Repeat("x", DefaultMaxBodyBytes) + `"}`
	go fmt.Fprintf(conn, "POST /v1/charges HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	br := bufio.NewReader(conn)
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge || !resp.Close {
		t.Fatalf("status %d, Connection %q; want 413 and close", resp.StatusCode, resp.Header.Get("Connection"))
	}
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := br.ReadByte(); errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatal("the connection stayed open after a 413")
	} else if err != io.EOF {
		t.Logf("connection ended with %v", err)
	}
}
