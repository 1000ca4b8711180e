package api

import (
	"bytes"
	"strings"
	"testing"
)

// TestMonitorShowsWholeTaskIDs: the asynqmon version in go.mod ships uuidPrefix in the
// minified form wholeTaskIDs replaces, exactly once, and the API serves the patched
// script at the path the index page loads. When asynqmon is upgraded and this fails,
// find uuidPrefix (ui/src/utils.ts) in the new build's main chunk and update
// uuidPrefixJS.
func TestMonitorShowsWholeTaskIDs(t *testing.T) {
	a := newTestAPI(t, nil)
	index, _, err := monitorIndex(a.s.monitor, "/monitoring")
	if err != nil {
		t.Fatal(err)
	}
	path, js, err := wholeTaskIDs(a.s.monitor, index)
	if err != nil {
		t.Fatalf("asynqmon's script cannot be patched: %v", err)
	}
	if uuidPrefixJS.Match(js) || !bytes.Contains(js, []byte("(e){return e}")) {
		t.Fatal("the patched script still cuts task IDs")
	}

	got := a.do(t, "GET", path, "").want(t, 200)
	if got.body != string(js) || !strings.HasPrefix(got.header.Get("Content-Type"), "application/javascript") {
		t.Fatalf("%s: %s %d bytes, want the patched script", path, got.header.Get("Content-Type"), len(got.body))
	}
	if got.header.Get("Content-Security-Policy") == "" || got.header.Get("Cache-Control") != "no-store" {
		t.Fatalf("%s is served without the dashboard's headers: %v", path, got.header)
	}
	// The index page loads it, and carries the ledger link script, pinned in its CSP.
	page := a.do(t, "GET", "/monitoring/", "").want(t, 200, `<script src="`+path+`">`, `idemq-ledger-link`)
	for _, h := range hashes(inlineScripts, []byte(page.body)) {
		if !strings.Contains(page.header.Get("Content-Security-Policy"), h) {
			t.Fatalf("inline script %s not in the CSP", h)
		}
	}
}

func TestUUIDPrefixPatternFailsLoudly(t *testing.T) {
	// A build where the function reads otherwise: no match, an error, not a silent pass.
	if n := len(uuidPrefixJS.FindAllIndex([]byte(`function cn(e){var t=e.indexOf("_");return-1===t?e:e.substr(0,t)}`), -1)); n != 0 {
		t.Fatalf("%d matches of another function", n)
	}
}
