package api

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"io/fs"
	"net/http"
	"regexp"
	"strings"
)

var (
	// webFontLinks are the Google Fonts stylesheets asynqmon's index page links. idemq
	// serves the page without them, so that no third-party origin is needed (nor told of
	// each visit); the UI falls back to a system font.
	webFontLinks = regexp.MustCompile(`<link rel="stylesheet" href="https://fonts\.googleapis\.com/[^"]*"/?>`)
	// inlineScripts are the <script> elements of a page that carry their code inline.
	inlineScripts = regexp.MustCompile(`(?s)<script>(.*?)</script>`)
	// inlineStyles are the <style> elements of a page.
	inlineStyles = regexp.MustCompile(`(?s)<style>(.*?)</style>`)
)

// monitorCSP is the dashboard's Content-Security-Policy, given the hashes of its index
// page's inline scripts. Its React UI loads its code, icons and manifest from 'self' and
// talks to /monitoring/api/ only; it has no style sheet files, but Material UI writes
// <style> elements at run time, hence style-src 'unsafe-inline' (scripts stay pinned).
// The browser test finds no violation on its pages under this policy, and one for each
// source taken away.
func monitorCSP(scriptHashes []string) string {
	return "default-src 'none'; script-src 'self' " + strings.Join(scriptHashes, " ") +
		"; style-src 'unsafe-inline'; img-src 'self'; connect-src 'self'; manifest-src 'self'" +
		"; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
}

// ledgerCSP is the ledger pages' Content-Security-Policy: no scripts, no images, the
// <style> elements of their templates pinned by hash, and their forms sent to this server.
var ledgerCSP = func() string {
	names, err := fs.Glob(templateFS, "templates/*.html")
	if err != nil {
		panic(err)
	}
	var styles []string
	for _, name := range names {
		page, err := templateFS.ReadFile(name)
		if err != nil {
			panic(err)
		}
		styles = append(styles, hashes(inlineStyles, page)...)
	}
	return "default-src 'none'; style-src " + strings.Join(styles, " ") +
		"; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
}()

// hashes are the CSP hash sources ('sha256-…') of what re's first group matches in page.
func hashes(re *regexp.Regexp, page []byte) []string {
	var out []string
	for _, m := range re.FindAllSubmatch(page, -1) {
		sum := sha256.Sum256(m[1])
		out = append(out, "'sha256-"+base64.StdEncoding.EncodeToString(sum[:])+"'")
	}
	return out
}

// monitorIndex renders asynqmon's index page once (it depends only on asynqmon's
// options), without its web-font links, and returns it with the CSP that lets it run.
func monitorIndex(monitor http.Handler, root string) ([]byte, string, error) {
	rec := &pageRecorder{header: http.Header{}, code: http.StatusOK}
	req, err := http.NewRequest(http.MethodGet, root+"/", nil)
	if err != nil {
		return nil, "", err
	}
	monitor.ServeHTTP(rec, req)
	page := rec.body.Bytes()
	if rec.code != http.StatusOK || !bytes.HasPrefix(page, indexStart) {
		return nil, "", fmt.Errorf("asynqmon's index page: status %d, %.60q", rec.code, page)
	}
	page = webFontLinks.ReplaceAll(page, nil)
	scripts := hashes(inlineScripts, page)
	if len(scripts) == 0 {
		return nil, "", fmt.Errorf("asynqmon's index page has no inline script: %.200q", page)
	}
	return page, monitorCSP(scripts), nil
}

// indexStart is how asynqmon's index page, and none of its other answers, begins.
var indexStart = []byte("<!doctype html>")

// pageRecorder keeps what a handler answers.
type pageRecorder struct {
	header http.Header
	code   int
	body   bytes.Buffer
}

func (r *pageRecorder) Header() http.Header         { return r.header }
func (r *pageRecorder) WriteHeader(code int)        { r.code = code }
func (r *pageRecorder) Write(b []byte) (int, error) { return r.body.Write(b) }

// withIndex serves monitor, answering with index where monitor answers with its own
// index page (for every path of its single-page UI that is not a file or /api/).
func withIndex(monitor http.Handler, index []byte) http.Handler {
	if index == nil {
		return monitor
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		monitor.ServeHTTP(&indexWriter{ResponseWriter: w, index: index}, r)
	})
}

// indexWriter passes a response through, unless it is asynqmon's index page: that
// begins with indexStart and has no Content-Type set before its first write. Then it
// sends index instead and drops what asynqmon writes.
type indexWriter struct {
	http.ResponseWriter
	index   []byte
	started bool
	drop    bool
}

func (w *indexWriter) WriteHeader(code int) {
	w.started = true
	w.ResponseWriter.WriteHeader(code)
}

func (w *indexWriter) Write(b []byte) (int, error) {
	if !w.started {
		w.started = true
		if w.Header().Get("Content-Type") == "" && bytes.HasPrefix(b, indexStart) {
			w.drop = true
			w.Header().Set("Content-Type", "text/html; charset=utf-8")
			if _, err := w.ResponseWriter.Write(w.index); err != nil {
				return 0, err
			}
		}
	}
	if w.drop {
		return len(b), nil
	}
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (w *indexWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
