package store

import (
	"io/fs"
	"strings"
	"testing"
	"text/template"
	"text/template/parse"
	"time"
)

// Every file of sql/ is used: a statement the package rendered when it was initialized,
// or a fragment such a statement includes.
func TestEverySQLFileIsUsed(t *testing.T) {
	t.Parallel()
	paths, err := fs.Glob(sqlFiles, "sql/*.sql")
	if err != nil || len(paths) == 0 {
		t.Fatalf("sql/*.sql: %v, %d files", err, len(paths))
	}
	used := map[string]bool{}
	var include func(name string)
	include = func(name string) {
		if used[name] {
			return
		}
		used[name] = true
		tmpl := sqlSet.Lookup(name)
		if tmpl == nil {
			t.Errorf("sql/%s.sql is included but missing", name)
			return
		}
		var walk func(parse.Node)
		walk = func(n parse.Node) {
			switch n := n.(type) {
			case *parse.ListNode:
				if n != nil {
					for _, c := range n.Nodes {
						walk(c)
					}
				}
			case *parse.IfNode:
				walk(n.List)
				walk(n.ElseList)
			case *parse.RangeNode:
				walk(n.List)
				walk(n.ElseList)
			case *parse.WithNode:
				walk(n.List)
				walk(n.ElseList)
			case *parse.TemplateNode:
				include(n.Name)
			}
		}
		walk(tmpl.Tree.Root)
	}
	for name := range sqlUsed {
		include(name)
	}
	for _, p := range paths {
		if name := strings.TrimSuffix(strings.TrimPrefix(p, "sql/"), ".sql"); !used[name] {
			t.Errorf("%s is not used", p)
		}
	}
}

// Every placeholder of a rendered statement was filled: none is left in the text, and
// one the values do not fill, or a file that is not there, panics with the file's name.
func TestEveryPlaceholderIsResolved(t *testing.T) {
	t.Parallel()
	stmts := []string{ClaimMany.SQL, claimSettingsSQL, readKeysSQL, undoSQL, lockTimeoutSQL, eventsSettingsSQL,
		takePendingSQL, staleIntentsSQL, intentInfoSQL, GetSQL, ReadStepsSQL}
	for _, lease := range []string{"", LeaseLive, LeaseLapsed} {
		sql, args := FindSQL(FindParams{Status: "s", StartedBefore: time.Hour, Lease: lease, HasDuplicates: true, Limit: 5})
		if !strings.HasSuffix(sql, "LIMIT $3") || len(args) != 3 {
			t.Errorf("FindSQL: %d arguments for\n%s", len(args), sql)
		}
		stmts = append(stmts, sql)
	}
	for _, w := range []*Writes{Fenced, Unfenced} {
		stmts = append(stmts, w.Heartbeat, w.HeartbeatMany, w.FinishMany.SQL, w.HoldKeys, w.HoldKeyWait, w.FinishTx,
			w.RecordStepSQL, w.HoldStepSQL, w.InsertStepSQL)
	}
	for _, s := range stmts {
		if strings.Contains(s, "{{") || strings.Contains(s, "}}") || s == "" {
			t.Errorf("a statement with a placeholder left, or empty:\n%s", s)
		}
	}
	panics := func(name string, f func()) (msg string) {
		t.Helper()
		defer func() {
			if r := recover(); r != nil {
				msg, _ = r.(string)
			}
		}()
		f()
		t.Errorf("%s did not panic", name)
		return ""
	}
	if msg := panics("a missing file", func() { sqlTemplate("no_such_statement") }); !strings.Contains(msg, "sql/no_such_statement.sql") {
		t.Errorf("a missing file panics with %q", msg)
	}
	for _, text := range []string{`SELECT {{.Nope}}`, `SELECT {{template "no_such_fragment"}}`} {
		tmpl := template.Must(template.Must(sqlSet.Clone()).New("bad").Parse(text))
		for _, data := range []any{nil, checkFence} {
			if msg := panics(text, func() { render(tmpl, data) }); !strings.Contains(msg, "sql/bad.sql") {
				t.Errorf("%s with %T panics with %q", text, data, msg)
			}
		}
	}
}
