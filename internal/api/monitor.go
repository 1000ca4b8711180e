package api

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
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
	page = withLedgerLink(webFontLinks.ReplaceAll(page, nil), root)
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

var (
	// uuidPrefixJS is asynqmon's uuidPrefix (ui/src/utils.ts) as its build minifies it.
	// The task lists (and the servers' active workers) show a task ID through it, cut at
	// its first '-' as if every ID were a UUID: charge:order-123 shows as charge:order,
	// and keys that differ after their first '-' look the same.
	uuidPrefixJS = regexp.MustCompile(`function ([A-Za-z_$][\w$]*)\(e\)\{var t=e\.indexOf\("-"\);return-1===t\?e:e\.substr\(0,t\)\}`)
	// mainScriptTag is the <script> element of asynqmon's index page that loads its
	// application code.
	mainScriptTag = regexp.MustCompile(`<script src="([^"]*/static/js/main\.[0-9a-f]+\.chunk\.js)"></script>`)
)

// wholeTaskIDs returns the path of asynqmon's application script, named in its index
// page, and the script with uuidPrefix made the identity, so that the dashboard shows
// every task ID whole. It is an error unless the script holds exactly one uuidPrefix in
// the minified form this asynqmon version ships (TestMonitorShowsWholeTaskIDs fails
// then: a new asynqmon version needs a new pattern).
func wholeTaskIDs(monitor http.Handler, index []byte) (string, []byte, error) {
	m := mainScriptTag.FindSubmatch(index)
	if m == nil {
		return "", nil, fmt.Errorf("asynqmon's index page names no main script: %.200q", index)
	}
	path := string(m[1])
	rec := &pageRecorder{header: http.Header{}, code: http.StatusOK}
	req, err := http.NewRequest(http.MethodGet, path, nil)
	if err != nil {
		return "", nil, err
	}
	monitor.ServeHTTP(rec, req)
	js := rec.body.Bytes()
	if rec.code != http.StatusOK || !strings.HasPrefix(rec.header.Get("Content-Type"), "application/javascript") {
		return "", nil, fmt.Errorf("asynqmon's %s: status %d, Content-Type %q", path, rec.code, rec.header.Get("Content-Type"))
	}
	if n := len(uuidPrefixJS.FindAllIndex(js, -1)); n != 1 {
		return "", nil, fmt.Errorf("asynqmon's %s: %d minified uuidPrefix functions, want 1", path, n)
	}
	return path, uuidPrefixJS.ReplaceAll(js, []byte("function ${1}(e){return e}")), nil
}

// serveScript answers with js, asynqmon's application script as wholeTaskIDs patched it.
func serveScript(js []byte) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/javascript; charset=utf-8")
		w.Write(js)
	})
}

// ledgerLinkJS is the script idemq adds to asynqmon's index page: on a task's page
// (<root>/queues/<queue>/tasks/<id>) it shows a link to the ledger row of the task's
// key, the task ID without a republish's #r<n>. The id is read as asynqmon reads it:
// its router decodes the path once (decodeURI) and the API server once more.
const ledgerLinkJS = `(function(){var root=%s;` +
	`function taskID(){var p=location.pathname;if(p.indexOf(root+"/queues/")!==0)return null;` +
	`var m=p.slice(root.length).match(/^\/queues\/[^\/]+\/tasks\/([^\/]+)\/?$/);if(!m)return null;` +
	`try{return decodeURIComponent(decodeURI(m[1]))}catch(e){return null}}` +
	`function sync(){var a=document.getElementById("idemq-ledger-link"),id=taskID();` +
	`if(id===null){if(a)a.remove();return}` +
	`var key=id.replace(/#r[0-9]+$/,""),href="/ledger/"+encodeURIComponent(key);` +
	`if(!a){a=document.createElement("a");a.id="idemq-ledger-link";` +
	`a.style.cssText="position:fixed;right:16px;bottom:16px;z-index:2000;padding:8px 14px;border-radius:6px;` +
	`background:#1d2330;color:#fff;font:14px system-ui,sans-serif;text-decoration:none;box-shadow:0 2px 6px #0004";` +
	`document.body.appendChild(a)}` +
	`if(a.getAttribute("href")!==href){a.setAttribute("href",href);a.textContent="Ledger row of "+key}}` +
	`sync();setInterval(sync,300)})();`

// withLedgerLink adds ledgerLinkJS, for a dashboard served at root, to the end of
// asynqmon's index page.
func withLedgerLink(page []byte, root string) []byte {
	quoted, _ := json.Marshal(root)
	script := "<script>" + fmt.Sprintf(ledgerLinkJS, quoted) + "</script></body>"
	return bytes.Replace(page, []byte("</body>"), []byte(script), 1)
}
