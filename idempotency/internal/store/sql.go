package store

import (
	"embed"
	"fmt"
	"io/fs"
	"strings"
	"text/template"
)

// The text of every statement lives in sql/, one file per statement, named after it
// (claim_many.sql is ClaimMany's); a fragment several statements share (a column list,
// the settings a statement puts back) has a file of its own too. A file's leading "--"
// lines are its documentation: they are dropped, with the blank lines before the
// statement and the white space after it, so that what is sent is the statement alone.
//
// A file is a text/template: {{template "name"}} is the text of sql/name.sql, and {{.X}}
// a value the Go side gives, such as a fenced write's checks (fenceChecks) or a filter
// of the console's list. Every statement is rendered once, when the package is
// initialized; a missing file or an unknown placeholder panics there.

//go:embed sql/*.sql
var sqlFiles embed.FS

// sqlSet holds every file of sql/ as a template named after the file, without ".sql".
var sqlSet = parseSQL()

// sqlUsed records the files a statement was rendered from (sqlTemplate), for the test
// that every file is used. It is written only while the package is initialized.
var sqlUsed = map[string]bool{}

func parseSQL() *template.Template {
	set := template.New("").Option("missingkey=error")
	paths, err := fs.Glob(sqlFiles, "sql/*.sql")
	if err == nil && len(paths) == 0 {
		err = fs.ErrNotExist
	}
	if err != nil {
		panic(fmt.Sprintf("store: the statements in sql/: %v", err))
	}
	for _, path := range paths {
		b, err := sqlFiles.ReadFile(path)
		if err == nil {
			_, err = set.New(strings.TrimSuffix(strings.TrimPrefix(path, "sql/"), ".sql")).Parse(sqlBody(string(b)))
		}
		if err != nil {
			panic(fmt.Sprintf("store: %s: %v", path, err))
		}
	}
	return set
}

// sqlBody is a file's statement: its text after its leading comment and blank lines,
// without the white space at its end.
func sqlBody(s string) string {
	for s != "" {
		line, rest, _ := strings.Cut(s, "\n")
		if t := strings.TrimSpace(line); t != "" && !strings.HasPrefix(t, "--") {
			break
		}
		s = rest
	}
	return strings.TrimRight(s, " \t\r\n")
}

// sqlTemplate returns sql/name.sql's template; call it only while the package is
// initialized.
func sqlTemplate(name string) *template.Template {
	t := sqlSet.Lookup(name)
	if t == nil {
		panic(fmt.Sprintf("store: no statement sql/%s.sql", name))
	}
	sqlUsed[name] = true
	return t
}

// sqlText renders sql/name.sql with data (nil for a file without values), once, while
// the package is initialized.
func sqlText(name string, data any) string {
	return render(sqlTemplate(name), data)
}

// render renders t with data; it panics if t holds a placeholder data does not fill.
func render(t *template.Template, data any) string {
	var b strings.Builder
	if err := t.Execute(&b, data); err != nil {
		panic(fmt.Sprintf("store: sql/%s.sql: %v", t.Name(), err))
	}
	return b.String()
}
