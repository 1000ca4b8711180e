// Package docs holds idemq's documentation pages; its test checks that the README stays a
// newcomer's page and that every link between the pages resolves.
package docs

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// maxReadme is the README's budget: what idemq is, a library example, the two commands,
// then links. Depth goes in docs/.
const maxReadme = 15 * 1024

func TestReadmeIsShort(t *testing.T) {
	info, err := os.Stat("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	if info.Size() > maxReadme {
		t.Errorf("README.md is %d bytes, over its %d-byte budget: move depth to docs/", info.Size(), maxReadme)
	}
}

var (
	mdLink  = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	heading = regexp.MustCompile("(?m)^(#{1,6}) +(.+?) *$")
	fence   = regexp.MustCompile("(?ms)^```.*?^```")
)

// TestLinksResolve follows every relative link of README.md, CHANGELOG.md and docs/*.md:
// the file must exist and, when the link names an anchor, the page must have that heading.
func TestLinksResolve(t *testing.T) {
	pages, _ := filepath.Glob("*.md")
	pages = append(pages, "../README.md", "../CHANGELOG.md")
	anchors := map[string]map[string]bool{}
	anchorsOf := func(path string) map[string]bool {
		if a, ok := anchors[path]; ok {
			return a
		}
		raw, err := os.ReadFile(path)
		if err != nil {
			return nil
		}
		a := map[string]bool{}
		seen := map[string]int{}
		for _, m := range heading.FindAllStringSubmatch(fence.ReplaceAllString(string(raw), ""), -1) {
			slug := slugify(m[2])
			if n := seen[slug]; n > 0 {
				a[slug+"-"+strconv.Itoa(n)] = true
			} else {
				a[slug] = true
			}
			seen[slug]++
		}
		anchors[path] = a
		return a
	}
	links := 0
	for _, page := range pages {
		raw, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		text := fence.ReplaceAllString(string(raw), "")
		for _, m := range mdLink.FindAllStringSubmatch(text, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			links++
			file, anchor, _ := strings.Cut(target, "#")
			path := page
			if file != "" {
				path = filepath.Join(filepath.Dir(page), file)
				if _, err := os.Stat(path); err != nil {
					t.Errorf("%s links to %s, which does not exist", page, target)
					continue
				}
			}
			if anchor == "" || !strings.HasSuffix(path, ".md") {
				continue
			}
			if !anchorsOf(path)[anchor] {
				t.Errorf("%s links to %s: %s has no heading #%s", page, target, path, anchor)
			}
		}
	}
	if links < 20 {
		t.Fatalf("found only %d relative links in %d pages: the link pattern is broken", links, len(pages))
	}
}

// slugify is GitHub's anchor for a heading: lower case, markup and punctuation dropped,
// spaces to hyphens.
func slugify(h string) string {
	h = strings.ToLower(h)
	h = regexp.MustCompile(`\[([^\]]*)\]\([^)]*\)`).ReplaceAllString(h, "$1")
	var b strings.Builder
	for _, r := range h {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
			b.WriteRune(r)
		case r > 127 && (r < 0x2000 || r > 0x2BFF): // letters beyond ASCII stay; dashes and symbols go
			b.WriteRune(r)
		}
	}
	return b.String()
}

// TestReadmeExampleCompiles checks that the README's library example is the body of
// idempotency/server's Example, which go vet and go test compile: the README cannot show
// code that does not build.
func TestReadmeExampleCompiles(t *testing.T) {
	src, err := os.ReadFile("../idempotency/server/example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	body := regexp.MustCompile(`(?ms)^func Example\(\) \{\n(.*?)^\}\n`).FindSubmatch(src)
	if body == nil {
		t.Fatal("idempotency/server/example_test.go has no func Example")
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimRight(string(body[1]), "\n"), "\n") {
		lines = append(lines, strings.TrimPrefix(l, "\t"))
	}
	want := "```go\n" + strings.Join(lines, "\n") + "\n```"
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), want) {
		t.Errorf("README.md does not quote idempotency/server's Example as it is; it should contain:\n%s", want)
	}
	if n := len(lines); n > 25 {
		t.Errorf("the README's example is %d lines, over 25", n)
	}
}

// section returns the text of page's section under heading, up to the next heading of
// its level or above.
func section(t *testing.T, page, heading string) string {
	t.Helper()
	raw, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	s := string(raw)
	i := strings.Index(s, "\n## "+heading+"\n")
	if i < 0 {
		t.Fatalf("%s has no section %q", page, heading)
	}
	s = s[i+len("\n## "+heading+"\n"):]
	if j := strings.Index(s, "\n## "); j >= 0 {
		s = s[:j]
	}
	return s
}

// TestSchemaTablesListedOnce: one page lists every table idemq's migrations create (both
// sets, and their version tables), and the guide links to that list rather than keeping
// one of its own.
func TestSchemaTablesListedOnce(t *testing.T) {
	core, _ := filepath.Glob("../migrations/*.sql")
	example, _ := filepath.Glob("../migrations/example/*.sql")
	tables := []string{"idemq_db_version", "idemq_example_db_version"}
	create := regexp.MustCompile(`(?mi)^CREATE TABLE (?:IF NOT EXISTS )?([a-z_]+)`)
	for _, f := range append(core, example...) {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range create.FindAllStringSubmatch(string(raw), -1) {
			tables = append(tables, m[1])
		}
	}
	list := section(t, "leases.md", "The schema beside yours")
	for _, table := range tables {
		if !strings.Contains(list, "`"+table+"`") {
			t.Errorf("docs/leases.md#the-schema-beside-yours does not list table %s", table)
		}
	}
	guide := section(t, "guide.md", "The schema beside yours")
	if !strings.Contains(guide, "(leases.md#the-schema-beside-yours)") {
		t.Errorf("docs/guide.md#the-schema-beside-yours does not link to the list of tables")
	}
	for _, table := range tables {
		if table != "idemq_db_version" && strings.Contains(guide, "`"+table+"`") {
			t.Errorf("docs/guide.md#the-schema-beside-yours names table %s: keep the one list in docs/leases.md", table)
		}
	}
}
